"""POST /v1/responses, OpenAI's Responses API, over the chat pipeline: request.py reads a body into the chat request
it means, builder.py answers in the API's shapes (shapes.py), routes.py joins them."""
