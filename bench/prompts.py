"""Real prompts for the real-model suite and the peers: chat turns, some that quote text the answer
is likely to repeat (where prompt lookup / n-gram drafting pays) and some open-ended ones."""

from __future__ import annotations

_CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""

_TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the reading room, the children's corner and the extended opening hours, "
    "but postponed the decision on the rooftop garden until the next meeting in March."
)

_QUESTIONS = [
    f"Add type hints and a docstring to this Python function:\n\n{_CODE}",
    f"Rewrite this paragraph in the passive voice, keeping every detail:\n\n{_TEXT}",
    "Explain in a few sentences why the sky is blue.",
    f"Rename the variable `total` to `running_sum` in this code:\n\n{_CODE}",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    f"Summarise this paragraph, then quote it in full:\n\n{_TEXT}",
    "List five tips for writing clear technical documentation.",
    "What are the main differences between a list and a tuple in Python?",
]
_TYPOS = (
    "Our team will recieve the new equipmnet next week. Untill then, please keep using the old "
    "printers on the secnd floor and report any problms to the help desk as soon as posible."
)
# input-grounded chat turns (issue 17's n-gram line): the answer repeats most of the text it is given.
# Appended after the first eight, so that presets taking the first N prompts keep their set.
_GROUNDED = [
    f"Fix the spelling mistakes in this paragraph and give it back in full:\n\n{_TYPOS}",
    f"Add a comment above each line of this Python function:\n\n{_CODE}",
    f"Turn this paragraph into a bulleted list, one clause per bullet, keeping the wording:\n\n{_TEXT}",
    f"Change this function so that it raises TypeError when `window` is not an int, and show the whole "
    f"function:\n\n{_CODE}",
]
PROMPTS: list[list[dict]] = [[{"role": "user", "content": q}] for q in _QUESTIONS + _GROUNDED]
NUM_GENERAL = len(_QUESTIONS)  # the first prompts, general and grounded mixed: the default sets
# the indices of the prompts whose answer quotes their input (bench.serve.prompt_indices)
GROUNDED = [0, 1, 3, 5, 8, 9, 10, 11]


def chat_prompts(num: int) -> list[list[dict]]:
    """The first ``num`` of the eight general prompts (cycled when more are asked for)."""
    if num < 1:
        raise ValueError(f"number of prompts must be >= 1, got {num}")
    return [PROMPTS[i % NUM_GENERAL] for i in range(num)]


# 64 short chat requests (4 forms x 16 topics): the deterministic-mode tests' and probe's prompts
GRID_TOPICS = [
    "the water cycle", "how a bicycle works", "prime numbers", "the French revolution", "photosynthesis",
    "black holes", "how to bake bread", "the history of chess", "volcanoes", "machine learning",
    "the moon landing", "coral reefs", "the printing press", "how vaccines work", "jazz music",
    "the Roman empire",
]  # fmt: skip
GRID_FORMS = ["Explain {} to a child.", "Write a short poem about {}.", "Give three facts about {}.",
              "Summarise {} in two sentences."]  # fmt: skip


def chat_grid() -> list[str]:
    """The 64 user messages, form-major (index 24 = form 1, topic 8)."""
    return [f.format(t) for f in GRID_FORMS for t in GRID_TOPICS]
