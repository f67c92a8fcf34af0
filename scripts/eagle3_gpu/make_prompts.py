"""Synthesize the training prompts (HERE, not on the device): templates × topics over chat,
explanations, stories and poems, math word problems, code tasks with small snippets, rewriting
and summarizing generated passages, and structured output. The bench's prompts
(../shared/prompts/dev.jsonl) must not leak in: their topics are left out of the lists, and a
prompt sharing any 6-word run with a bench prompt is dropped (counted in the summary).

Writes an .npz: ids (all prompts' chat-templated token ids, int32, concatenated), offsets
[n+1], categories [n] (index into `category_names`), and the texts as a JSON string.
Usage: python make_prompts.py OUT.npz [--count N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared/prompts/dev.jsonl"

SUBJECTS = [
    "photosynthesis", "volcanoes", "the water cycle", "black holes", "vaccines", "compound interest",
    "inflation", "plate tectonics", "the immune system", "solar panels", "electric cars", "recycling",
    "the Roman Empire", "the printing press", "the Industrial Revolution", "climate change", "coral reefs",
    "honeybees", "sleep", "meditation", "exercise", "nutrition", "the human heart", "DNA", "evolution",
    "gravity", "magnetism", "rainbows", "tides", "earthquakes", "hurricanes", "the moon landing", "Mars",
    "the internet", "encryption", "databases", "machine learning", "neural networks", "cloud computing",
    "open source software", "version control", "unit testing", "recursion", "sorting algorithms",
    "hash tables", "linked lists", "binary search", "operating systems", "compilers", "web browsers",
    "email", "GPS", "batteries", "nuclear power", "wind turbines", "bridges", "skyscrapers", "airplanes",
    "submarines", "trains", "bicycles", "chess", "music theory", "jazz", "the violin", "painting",
    "photography", "film editing", "poetry", "the novel", "libraries", "museums", "democracy", "taxes",
    "supply and demand", "banks", "stock markets", "budgeting", "saving money", "public speaking",
    "time management", "learning a language", "gardening", "composting", "baking bread", "coffee", "tea",
    "chocolate", "cheese making", "fermentation", "dinosaurs", "whales", "octopuses", "wolves", "owls",
    "ants", "rain forests", "deserts", "glaciers", "rivers", "mountains", "the Sahara", "the Amazon",
    "ancient Egypt", "the Silk Road", "the Renaissance", "the Olympic Games", "marathons", "yoga",
    "first aid", "friendship", "remote work", "job interviews", "writing a resume", "teamwork",
    "negotiation", "critical thinking", "the scientific method", "statistics", "probability", "fractions",
    "prime factorization", "geometry", "algebra", "calculus", "maps", "weather forecasts", "clocks",
    "calendars", "paper making", "glass", "steel", "plastics", "concrete", "3D printing", "robots",
    "drones", "satellites", "telescopes", "microscopes", "antibiotics", "allergies", "the brain",
    "memory", "habits", "motivation", "kindness", "city parks", "public transport", "traffic lights",
]
PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "disk storage"), ("a list", "a tuple"),
    ("an alligator", "a crocodile"), ("speed", "velocity"), ("mass", "weight"), ("a lake", "a pond"),
    ("HTTP", "HTTPS"), ("a compiler", "an interpreter"), ("stocks", "bonds"), ("a simile", "a metaphor"),
    ("baking soda", "baking powder"), ("a comet", "an asteroid"), ("AC", "DC current"),
    ("a democracy", "a monarchy"), ("frogs", "toads"), ("git merge", "git rebase"), ("SQL", "NoSQL"),
    ("a process", "a thread"), ("latitude", "longitude"), ("a debit card", "a credit card"),
    ("renting", "buying a home"), ("weather balloons", "satellites"), ("an array", "a linked list"),
    ("classical", "operant conditioning"), ("an atom", "a molecule"), ("a hurricane", "a tornado"),
]
PEOPLE = ["a young baker", "an old sailor", "a curious robot", "a retired teacher", "a shy dragon",
          "a street musician", "a tired detective", "a lost cat", "two rival chefs", "a school librarian",
          "a beekeeper", "a night-shift nurse", "a clockmaker", "a child astronaut", "a stubborn goat",
          "a mail carrier", "a forest ranger", "a chess prodigy", "a talking parrot", "an inventor",
          "a farmer", "a painter who lost her colors", "a tiny snail", "a nervous magician"]
PLACES = ["in a snowy village", "on a space station", "in a busy market", "at the bottom of the sea",
          "in a haunted library", "on a desert island", "in a small bakery", "on a night train",
          "in a mountain cabin", "in a floating city", "in an old bookshop", "at a summer fair",
          "in a rainy harbor town", "inside a giant tree", "on the first day of school", "at a bus stop"]
TWISTS = ["finds a mysterious key", "has to solve a riddle", "makes an unexpected friend", "loses something precious",
          "discovers a secret door", "must win a competition", "learns to be patient", "gets a strange letter",
          "helps a stranger", "sees a shooting star", "hears a song nobody else hears", "breaks a promise"]
POEM_TOPICS = ["the ocean at night", "a first snowfall", "an old friend", "morning coffee", "a thunderstorm",
               "the stars", "a quiet forest", "a childhood home", "spring rain", "a busy highway",
               "a candle", "the desert wind", "a garden", "the last day of summer", "a cat asleep in the sun",
               "the moon over a river", "mountains", "a library", "hope", "time passing", "a kite", "the sea"]
POEM_FORMS = ["a short poem", "a haiku", "a limerick", "a four-line rhyming poem", "a free-verse poem",
              "a sonnet", "a two-stanza poem", "a cheerful poem", "a sad poem"]
STYLES = ["for a five-year-old", "in simple terms", "in two paragraphs", "in one paragraph", "step by step",
          "with an analogy", "for a high-school student", "in under 100 words", "as if to a new employee",
          "with three key points", "with an example"]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a smart thermostat",
            "a hiking backpack", "a coffee grinder", "an e-reader", "a camping tent", "a mechanical keyboard"]
NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lena", "Omar", "Priya", "Lucas", "Sofia", "Ben", "Chen", "Nadia"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "oranges", "cards", "stamps", "shells"]
FUNCS = [
    ("reverses a string", "reverse_string"), ("counts the vowels in a string", "count_vowels"),
    ("returns the factorial of n", "factorial"), ("checks if a string is a palindrome", "is_palindrome"),
    ("returns the n-th Fibonacci number", "fibonacci"), ("finds the largest number in a list", "find_max"),
    ("removes duplicates from a list while keeping order", "dedupe"), ("flattens a nested list", "flatten"),
    ("counts how often each word appears in a text", "word_counts"), ("converts Celsius to Fahrenheit", "c_to_f"),
    ("computes the average of a list of numbers", "average"), ("checks if two strings are anagrams", "is_anagram"),
    ("returns the greatest common divisor of two numbers", "gcd"), ("splits a list into chunks of size n", "chunks"),
    ("capitalizes the first letter of every word", "title_case"), ("sums the digits of an integer", "digit_sum"),
    ("returns the second largest number in a list", "second_largest"), ("merges two sorted lists", "merge_sorted"),
    ("validates a simple email address", "is_valid_email"), ("rotates a list by k positions", "rotate"),
]
LANGS = ["Python", "JavaScript", "Python", "Python", "Java", "C", "Go", "Rust", "TypeScript"]


def snippet(rng: random.Random) -> str:
    """A small Python or JavaScript function made from parts (names, constants and bodies vary)."""
    var = rng.choice(["items", "values", "data", "records", "rows", "entries", "numbers", "words"])
    acc = rng.choice(["total", "result", "count", "out", "acc", "answer"])
    k = rng.randint(2, 12)
    fname = rng.choice(["process", "compute", "summarize", "filter_items", "score", "tally", "build_report",
                        "clean", "transform", "check_all", "helper", "run"])
    py = [
        f"def {fname}({var}):\n    {acc} = 0\n    for x in {var}:\n        if x > {k}:\n            {acc} += x\n    return {acc}\n",
        f"def {fname}({var}):\n    {acc} = []\n    for x in {var}:\n        if x % {k} == 0:\n            {acc}.append(x * x)\n    return {acc}\n",
        f"def {fname}({var}, limit={k}):\n    {acc} = {{}}\n    for x in {var}:\n        {acc}[x] = {acc}.get(x, 0) + 1\n    return [key for key, n in {acc}.items() if n >= limit]\n",
        f"def {fname}({var}):\n    {acc} = ''\n    for line in {var}:\n        {acc} += line.strip() + '\\n'\n    return {acc}\n",
        f"def {fname}({var}):\n    {acc} = None\n    for x in {var}:\n        if {acc} is None or x < {acc}:\n            {acc} = x\n    return {acc}\n",
        f"def {fname}({var}):\n    {acc} = 0\n    for item in {var}:\n        {acc} += item['price'] * item['qty']\n    return round({acc}, {k % 4})\n",
        f"def {fname}(text):\n    {acc} = 0\n    for word in text.split():\n        if len(word) > {k}:\n            {acc} += 1\n    return {acc}\n",
        f"def {fname}({var}):\n    i = 0\n    while i < len({var}):\n        if {var}[i] == {k}:\n            return i\n        i += 1\n    return -1\n",
        f"class {fname.title().replace('_', '')}:\n    def __init__(self):\n        self.{var} = []\n\n    def add(self, x):\n        self.{var}.append(x)\n\n    def {acc}(self):\n        return sum(self.{var}) / max(len(self.{var}), 1)\n",
    ]
    js = [
        f"function {fname}({var}) {{\n  let {acc} = 0;\n  for (const x of {var}) {{\n    if (x > {k}) {acc} += x;\n  }}\n  return {acc};\n}}\n",
        f"function {fname}({var}) {{\n  const {acc} = [];\n  for (let i = 0; i < {var}.length; i++) {{\n    if ({var}[i] % {k} === 0) {acc}.push({var}[i]);\n  }}\n  return {acc};\n}}\n",
    ]
    return rng.choice(py + py + js)


def passage(rng: random.Random) -> str:
    """A short made-up paragraph to rewrite or summarize."""
    subject = rng.choice(SUBJECTS)
    who = rng.choice(["A small team", "The city council", "A local school", "Our company", "A group of students",
                      "The museum", "A neighborhood club", "The research lab"])
    did = rng.choice(["started a project about", "spent a year studying", "opened an exhibit on",
                      "wrote a report on", "organized a festival around", "ran a survey about"])
    n1, n2 = rng.randint(3, 40), rng.randint(50, 900)
    sentences = [
        f"{who} {did} {subject}.",
        f"At first only {n1} people took part, but by the end more than {n2} had joined.",
        rng.choice(["The biggest challenge was finding enough time and money to keep going.",
                    f"Many participants said they had never thought much about {subject} before.",
                    "Volunteers met every week to plan the next steps and share what they had learned.",
                    "Local newspapers wrote about the effort several times during the year."]),
        rng.choice(["In the end, the organizers decided to repeat the project next year.",
                    "The results were shared in a short public talk that filled the room.",
                    "Some people were disappointed that the work moved slowly, but most stayed involved.",
                    "A second phase will focus on teaching others what the group discovered."]),
    ]
    if rng.random() < 0.5:
        sentences.insert(2, f"Each session lasted about {rng.randint(1, 4)} hours and covered a different topic.")
    return " ".join(sentences)


def math_problem(rng: random.Random) -> str:
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
    kind = rng.randrange(10)
    if kind == 0:
        return f"{name} has {a} {item}. {name} gives {b} to {other} and then buys {c} times as many as {name} gave away. How many {item} does {name} have now?"
    if kind == 1:
        return f"A shop sells {item} at ${c}.{rng.randint(10, 95)} each. How much do {a} {item} cost? Show your work."
    if kind == 2:
        return f"A car drives {a * 10} km in {c} hours. What is its average speed? If it keeps this speed, how far will it go in {c + 2} hours?"
    if kind == 3:
        return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"
    if kind == 4:
        return f"{name} saves ${b} every week. How many weeks will it take to save ${b * a + rng.randint(1, b)}? Explain your reasoning."
    if kind == 5:
        return f"What is {rng.randint(10, 40)}% of {a * 20}? Show the calculation."
    if kind == 6:
        return f"Solve for x: {c}x + {a} = {c * b + a}. Explain each step."
    if kind == 7:
        return f"A class has {a + 10} students. {b} of them walk to school, and the rest take the bus. What fraction of the class takes the bus?"
    if kind == 8:
        return f"A recipe needs {c} eggs for {b} servings. How many eggs are needed for {b * c} servings?"
    return f"{name} reads {b} pages a day. The book has {a * 10 + b} pages. After {c} days, how many pages are left?"


def build(rng: random.Random) -> tuple[str, str]:
    """One (category, prompt)."""
    cat = rng.choices(["chat", "explain", "creative", "math", "code", "grounded", "structured"],
                      weights=[18, 16, 16, 14, 16, 10, 10])[0]
    s = rng.choice(SUBJECTS)
    if cat == "chat":
        a, b = rng.choice(PAIRS)
        return cat, rng.choice([
            f"What is {s}?", f"Why is {s} important?", f"Can you tell me some interesting facts about {s}?",
            f"What is the difference between {a} and {b}?", f"How do I get started with {s}?",
            f"What are the pros and cons of {s}?", f"I'm curious about {s}. Where should I begin?",
            f"Give me three tips for {rng.choice(['saving money', 'sleeping better', 'studying', 'cooking at home', 'staying focused', 'learning to code', 'running a meeting', 'writing emails'])}.",
            f"What are common mistakes people make with {s}?", f"How has {s} changed over the last hundred years?",
            f"Should I buy {rng.choice(PRODUCTS)}? What should I look for?",
            f"My friend says {a} and {b} are the same thing. Is that right?",
            f"Hi! Can you help me plan a {rng.choice(['weekend', 'birthday party', 'study schedule', 'trip', 'workout week'])}?",
            f"What does a {rng.choice(['data scientist', 'nurse', 'pilot', 'librarian', 'carpenter', 'chef', 'lawyer'])} do all day?",
        ])
    if cat == "explain":
        return cat, rng.choice([
            f"Explain {s} {rng.choice(STYLES)}.", f"How does {s} work?", f"Describe {s} {rng.choice(STYLES)}.",
            f"Teach me the basics of {s}.", f"Summarize what scientists know about {s}.",
            f"Explain the history of {s} in a few paragraphs.", f"What would happen if {s} disappeared tomorrow?",
        ])
    if cat == "creative":
        return cat, rng.choice([
            f"Write a short story about {rng.choice(PEOPLE)} {rng.choice(PLACES)} who {rng.choice(TWISTS)}.",
            f"Tell me a story about {rng.choice(PEOPLE)} {rng.choice(PLACES)}.",
            f"Write {rng.choice(POEM_FORMS)} about {rng.choice(POEM_TOPICS)}.",
            f"Write a bedtime story for a child about {rng.choice(PEOPLE)}.",
            f"Write a diary entry from {rng.choice(PEOPLE)} {rng.choice(PLACES)}.",
            f"Write a funny dialogue between {rng.choice(PEOPLE)} and {rng.choice(PEOPLE)}.",
            f"Write a product description for {rng.choice(PRODUCTS)}.",
            f"Write a short speech for {rng.choice(['a graduation', 'a wedding', 'a retirement party', 'a team kickoff', 'a science fair'])}.",
            f"Write a friendly email to {rng.choice(NAMES)} about {rng.choice(['a delayed order', 'a team lunch', 'a new schedule', 'a thank-you', 'a project update'])}.",
        ])
    if cat == "math":
        return cat, math_problem(rng)
    if cat == "code":
        desc, fname = rng.choice(FUNCS)
        code = snippet(rng)
        return cat, rng.choice([
            f"Write a {rng.choice(LANGS)} function called {fname} that {desc}.",
            f"Write a {rng.choice(LANGS)} function that {desc}. Include a short example.",
            f"How would you write a function that {desc} in {rng.choice(LANGS)}? Explain your approach.",
            f"Explain what this code does:\n\n{code}", f"Explain this function line by line.\n\n{code}",
            f"Can you make this code shorter and more readable?\n\n{code}",
            f"Find and fix any bugs in this function, and explain the fix:\n\n{code}",
            f"Write three unit tests for this function:\n\n{code}", f"Add comments to this code:\n\n{code}",
            f"What is the time complexity of this function?\n\n{code}",
            f"Rename the variables in this function so the code is easier to read:\n\n{code}",
            f"Translate this function to {rng.choice(['Python', 'JavaScript', 'Go', 'Java', 'Rust'])}:\n\n{code}",
            f"What does this return for a small example input? Walk through it.\n\n{code}",
            f"How do I {rng.choice(['read a file line by line', 'sort a dictionary by value', 'parse JSON', 'make an HTTP request', 'handle exceptions', 'use a virtual environment', 'reverse a list', 'format a date', 'count items in a list', 'write a CSV file', 'use a class', 'run tasks in parallel'])} in {rng.choice(LANGS)}?",
        ])
    if cat == "grounded":
        text = passage(rng)
        return cat, rng.choice([
            f"Summarize this in one sentence:\n\n{text}", f"Summarize the following paragraph in two sentences.\n\n{text}",
            f"Rewrite this text in a more formal tone:\n\n{text}", f"Rewrite this for a young reader:\n\n{text}",
            f"List the main points of this text:\n\n{text}", f"What is the main idea of this paragraph?\n\n{text}",
            f"Turn this paragraph into a short news headline and a one-line summary.\n\n{text}",
            f"{text}\n\nWhat happened to the number of people who took part?",
        ])
    n = rng.randint(3, 8)
    return cat, rng.choice([
        f"List {n} facts about {s} as a numbered list.",
        f"Give me {n} ideas for {rng.choice(['a rainy day', 'a science project', 'a birthday gift', 'a blog post', 'a team activity', 'healthy snacks'])} as a bulleted list.",
        f"Return a JSON object describing {rng.choice(PRODUCTS)} with the keys \"name\", \"price\" and \"features\".",
        f"Make a table comparing {' and '.join(rng.choice(PAIRS))} with three rows.",
        f"List {n} {rng.choice(['animals that live in the ocean', 'famous painters', 'programming languages', 'fruits', 'board games', 'musical instruments', 'planets and one fact each'])} as a JSON array of strings.",
        f"Write a step-by-step checklist for {rng.choice(['moving house', 'starting a garden', 'preparing for an exam', 'setting up a laptop', 'planning a picnic'])}.",
        f"Give {n} pros and {n} cons of {s} in two lists.",
    ])


def bench_ngrams(n: int = 6) -> set[tuple[str, ...]]:
    grams: set[tuple[str, ...]] = set()
    if not BENCH.is_file():
        return grams
    for line in BENCH.read_text().splitlines():
        for m in json.loads(line).get("messages", []):
            words = re.findall(r"\w+", m["content"].lower())
            grams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return grams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    import jinja2
    from tokenizers import Tokenizer

    template = jinja2.Environment().from_string((ROOT / "engines/smollm2-135m/chat_template.jinja").read_text())
    tok = Tokenizer.from_file(str(ROOT / "engines/smollm2-135m/tokenizer.json"))
    grams = bench_ngrams()
    rng = random.Random(args.seed)
    seen, prompts, cats, dropped = set(), [], [], 0
    while len(prompts) < args.count:
        cat, text = build(rng)
        words = re.findall(r"\w+", text.lower())
        if text in seen:
            continue
        if any(tuple(words[i : i + 6]) in grams for i in range(len(words) - 5)):
            dropped += 1
            continue
        seen.add(text)
        prompts.append(text)
        cats.append(cat)
    names = sorted(set(cats))
    rendered = [template.render(messages=[{"role": "user", "content": t}], add_generation_prompt=True) for t in prompts]
    ids = [tok.encode(r).ids for r in rendered]
    offsets = np.cumsum([0] + [len(x) for x in ids])
    np.savez_compressed(args.out, ids=np.concatenate(ids).astype(np.int32), offsets=offsets.astype(np.int64),
                        categories=np.array([names.index(c) for c in cats], dtype=np.int8),
                        category_names=np.array(names), texts=np.array(json.dumps(prompts)))
    lengths = np.diff(offsets)
    print(f"{len(prompts)} prompts ({', '.join(f'{c} {cats.count(c)}' for c in names)}), "
          f"tokens per prompt {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), "
          f"{dropped} dropped for sharing a 6-word run with the bench")


if __name__ == "__main__":
    main()
