"""Chat prompts from another source than ShareGPT, for measuring a head on text unlike its training data.

Written for specserve, in the eight categories of MT-bench (writing, roleplay, reasoning, math, coding,
extraction, STEM, humanities), six first turns each. A head trained on ShareGPT answers accepts less on prompts
like these (the EAGLE issue measured 1.87 on held-out ShareGPT against 1.55 on MT-bench for the first head), so
a head's card quotes both. None of these texts is, or is contained in, the first turn of any of the 11,091
readable ShareGPT conversations (checked when they were written; training reads only first turns)."""

from __future__ import annotations

CHAT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("writing", "Write a short blog post about a weekend trip to a small coastal town, with two things to eat "
     "and one thing to avoid."),
    ("writing", "Draft a polite email to a landlord asking for the kitchen tap to be repaired before the end of "
     "the month."),
    ("writing", "Write a persuasive paragraph arguing that every school should teach basic cooking."),
    ("writing", "Compose a four-line poem about the first snow of the year."),
    ("writing", "Write a product description for a reusable water bottle that keeps drinks cold for a day."),
    ("writing", "Summarize the plot of a mystery novel you invent, in under 120 words, without revealing the "
     "culprit."),
    ("roleplay", "Pretend you are a museum guide. Welcome a group of visitors and introduce the dinosaur hall."),
    ("roleplay", "You are a ship's captain in a storm. Give your crew orders in a calm voice."),
    ("roleplay", "Act as a personal trainer and greet a new client who has never lifted weights."),
    ("roleplay", "Play the role of a librarian recommending three books to a teenager who likes space."),
    ("roleplay", "You are a chef on a cooking show. Explain what you are making today and why."),
    ("roleplay", "Imagine you are a detective. Describe what you notice when you walk into the empty office."),
    ("reasoning", "A farmer has 17 sheep and all but 9 run away. How many sheep are left? Explain your answer."),
    ("reasoning", "If it takes five machines five minutes to make five widgets, how long would it take 100 "
     "machines to make 100 widgets?"),
    ("reasoning", "Anna is taller than Ben, and Ben is taller than Carla. Is Carla taller than Anna? Explain."),
    ("reasoning", "Three boxes are labelled apples, oranges and mixed, and every label is wrong. You may take one "
     "fruit from one box. How do you fix the labels?"),
    ("reasoning", "What comes next in the sequence 2, 6, 12, 20, 30, and why?"),
    ("reasoning", "A clock shows 3:15. What is the angle between the hour and minute hands?"),
    ("math", "Solve for x: 3x + 7 = 25. Show each step."),
    ("math", "What is the area of a circle with a radius of 4 centimetres?"),
    ("math", "A shirt costs 40 dollars and is on sale for 25 percent off. What is the sale price?"),
    ("math", "Find the sum of the integers from 1 to 50."),
    ("math", "A train travels 180 kilometres in 2 hours. What is its average speed in metres per second?"),
    ("math", "What is the probability of rolling a total of 7 with two fair dice?"),
    ("coding", "Write a Python function that returns True if a string is a palindrome, ignoring case and spaces."),
    ("coding", "Explain the difference between a list and a tuple in Python, with an example of each."),
    ("coding", "Write a SQL query that lists the five customers with the highest total order amount."),
    ("coding", "Write a JavaScript function that removes duplicate numbers from an array."),
    ("coding", "How do I read a CSV file in Python and print the average of one column?"),
    ("coding", "Write a bash command that counts the lines in every .txt file in a folder."),
    ("extraction", "From this sentence, list every city and its country: 'We flew from Lisbon, Portugal to Osaka, "
     "Japan, with a stop in Dubai, United Arab Emirates.'"),
    ("extraction", "Extract the date, time and place from: 'The meeting moves to Thursday 14 March at 10:30 in "
     "room B2.'"),
    ("extraction", "Give the main idea of this review in one sentence: 'The phone is fast and the screen is "
     "bright, but the battery barely lasts a day and the camera struggles at night.'"),
    ("extraction", "Return the names and ages in this text as JSON: 'Maria is 34, her brother Tom is 29, and "
     "their father Jorge is 61.'"),
    ("extraction", "Which ingredients in this list are vegetables: carrots, flour, spinach, butter, onions, "
     "sugar, peppers?"),
    ("extraction", "Find the verbs in: 'She opened the window, took a deep breath and smiled at the garden.'"),
    ("stem", "Explain why the sky is blue in simple terms."),
    ("stem", "What is the difference between a virus and a bacterium?"),
    ("stem", "How does a refrigerator keep food cold?"),
    ("stem", "Describe the water cycle in a few sentences."),
    ("stem", "Why do we have seasons on Earth?"),
    ("stem", "What does a transistor do in an electronic circuit?"),
    ("humanities", "What were the main causes of the First World War?"),
    ("humanities", "Explain the idea of supply and demand with an everyday example."),
    ("humanities", "Who was Leonardo da Vinci and why is he remembered?"),
    ("humanities", "What is the difference between a democracy and a monarchy?"),
    ("humanities", "Give three tips for learning a new language as an adult."),
    ("humanities", "Why did the Roman Empire build roads, and how were they used?"),
)


def chat_prompt_messages(limit: int | None = None) -> list[list[dict[str, str]]]:
    """The prompts as one-turn chats, at most `limit` of them, taking each category's next prompt in turn so that
    a short run still covers every category."""
    by_category: dict[str, list[str]] = {}
    for category, text in CHAT_PROMPTS:
        by_category.setdefault(category, []).append(text)
    rounds = max(len(texts) for texts in by_category.values())
    ordered = [texts[i] for i in range(rounds) for texts in by_category.values() if i < len(texts)]
    return [[{"role": "user", "content": text}] for text in ordered[:limit]]
