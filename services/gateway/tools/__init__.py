"""Tool calls (OpenAI `tools` / `tool_choice`): the request and response shapes (schemas.py), the conversation as
the chat template wants it (template.py), the model's tool-call text parsed back into `tool_calls`, whole or
while streaming (one parser module per format, chosen by name: parsers.py), and `tool_choice` "required" or a
named function enforced through the verifier's grammar masks (grammar.py), so such output always parses."""
