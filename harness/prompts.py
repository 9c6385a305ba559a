"""The executor tests' prompts, which the bf16 tolerance (harness/precision.py) is stated
over: plain text, tokenized by the caller."""

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Paris is",
    "List three colors:\n1.",
]


# 16 prompts of 2 to 40-odd tokens for the concurrent test (16 requests at once).
MORE_PROMPTS = [
    "Hi",
    "The quick brown fox",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):",
    "Water boils at",
    "Translate to French: good morning",
    "A haiku about autumn leaves falling slowly onto a quiet pond at dusk, written by",
    "SELECT name FROM users WHERE",
    "The three laws of thermodynamics are",
    "1, 1, 2, 3, 5, 8,",
    "Dear hiring manager, I am writing to apply for the position of senior engineer at your "
    "company, which I learned about from a colleague who has worked with your team for",
    "Q: Why is the sky blue?\nA:",
]
