"""The prompt set `specchat train-draft` asks the target to answer (its greedy replies
are what a draft head must learn to predict): everyday chat, explanations, code to
write and to edit, short stories. Every eighth prompt is held out for validation. None of them is a
prompt of the benchmark sets (`../shared/prompts/dev_prompts.jsonl`, docs/bench-prompts/)
or asks for the same thing, so a head is not benchmarked on what it was trained on."""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    "How do I cook lentils so they stay firm?",
    "Explain what a hash table is and when to use one.",
    "Write a Python function that counts the vowels in a string.",
    "What is the difference between a list and a tuple in Python?",
    "What makes a cover letter stand out?",
    "Tell me a short story about a robot who learns to paint.",
    "What causes the seasons on Earth?",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "How does HTTPS keep a connection private?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "Write a bash one-liner that lists the five largest files in a folder.",
    "What is a good way to start learning the guitar?",
    "Explain recursion to a ten-year-old.",
    "Rewrite this function to use a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n        out.append(x * x)\n    return out",
    "What are the main differences between TCP and UDP?",
    "Write a haiku about autumn rain.",
    "How do I make a git branch and push it to a remote?",
    "What does the Python `with` statement do?",
    "Suggest a simple weekly workout plan for a beginner.",
    "Explain the difference between a process and a thread.",
    "Write a JavaScript function that debounces another function.",
    "Why is the sky blue?",
    "What is Big-O notation? Give two examples.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a quick tomato pasta sauce.",
    "Explain what a Docker container is and how it differs from a virtual machine.",
    "Write a unit test with pytest for a function add(a, b).",
    "What is the capital of Australia, and why is it not Sydney?",
    "Fix the bug in this code:\n\ndef mean(xs):\n    return sum(xs) / len(xs) + 1",
    "How do I read a CSV file with pandas and print its first rows?",
    "Tell me a bedtime story about a dragon who is afraid of the dark.",
    "What is the difference between `==` and `is` in Python?",
    "Explain how a binary search works, step by step.",
    "Write a regular expression that matches an email address, and explain it.",
    "What are some good habits for a productive morning?",
    "How does a CPU cache speed up programs?",
    "Write a Python function that returns the Fibonacci numbers below n as a list.",
    "What is photosynthesis?",
    "Explain what an API is with an everyday example.",
    "Convert this loop to use enumerate:\n\ni = 0\nfor name in names:\n    print(i, name)\n    i += 1",
    "What should I pack for a three-day hiking trip?",
    "Explain the difference between supervised and unsupervised learning.",
    "Write a function in C that reverses a string in place.",
    "How do I politely decline a meeting invitation?",
    "What is a closure in JavaScript?",
    "Describe the water cycle.",
    "Write a Python script that renames every .txt file in a folder to .md.",
    "What is the difference between weather and climate?",
    "Explain what a mutex is and why deadlocks happen.",
    "Write a short poem about the sea.",
    "How do I centre a div with CSS?",
    "What are prime numbers? List the first ten.",
    "Explain how public-key cryptography works in simple terms.",
    "Write a Python function that merges two sorted lists.",
    "Give me ideas for a birthday party for a seven-year-old.",
    "What is the difference between RAM and storage?",
    "Add type hints to this function:\n\ndef greet(name, times):\n    return ', '.join(['hello ' + name] * times)",
    "How does a refrigerator keep food cold?",
    "Explain what a linked list is and write one in Python.",
    "What are the benefits of reading every day?",
    "Write a Rust function that returns the largest number in a slice.",
    "How do I undo the last git commit but keep the changes?",
    "Tell me a story about a cat who becomes the mayor of a small town.",
)


def split(prompts: tuple[str, ...] = PROMPTS) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): every eighth one is held out."""
    train = [p for i, p in enumerate(prompts) if i % 8 != 7]
    held = [p for i, p in enumerate(prompts) if i % 8 == 7]
    return train, held
