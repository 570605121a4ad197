"""What the end-to-end tests send: the served model's name and a code-edit prompt whose answer copies much of
the prompt (so n-gram speculation accepts tokens)."""

MODEL = "smollm2-135m-instruct"
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.quantity\n"
    "    return result\n"
)
EDIT = f"Rename the function total to order_total and return the whole code:\n\n{CODE}"
NO_SPEC = {"speculative_config": {"method": "none"}}
