"""bench/prompts.py and the serve bench's prompt choice: the grounded set quotes its input, and the
default sets stay the first eight prompts however many are appended."""

from __future__ import annotations

import pytest

from specsched.bench.prompts import GROUNDED, NUM_GENERAL, PROMPTS, chat_prompts
from specsched.bench.serve import make_prompts
from specsched.bench.serve_config import DaemonRun, ServeConfig

ONE = [DaemonRun(name="base", kind="baseline")]


def test_grounded_prompts_carry_a_block_of_text_the_answer_repeats():
    assert len(set(GROUNDED)) == len(GROUNDED) == 8 and max(GROUNDED) < len(PROMPTS)
    for i in GROUNDED:
        content = PROMPTS[i][0]["content"]
        instruction, _, quoted = content.partition("\n\n")
        assert len(quoted) > 150, (i, instruction)  # a paragraph or a function to give back
    open_ended = [i for i in range(NUM_GENERAL) if i not in GROUNDED]
    assert all("\n\n" not in PROMPTS[i][0]["content"] for i in open_ended)


def test_default_sets_cycle_the_first_eight_prompts():
    assert NUM_GENERAL == 8 < len(PROMPTS)
    assert chat_prompts(10) == [PROMPTS[i % 8] for i in range(10)]
    cfg = ServeConfig(configs=ONE, num_prompts=10)
    assert [p["messages"] for p in make_prompts(cfg)] == [PROMPTS[i % 8] for i in range(10)]
    grounded = ServeConfig(configs=ONE, prompt_indices=GROUNDED)
    assert [p["messages"] for p in make_prompts(grounded)] == [PROMPTS[i] for i in GROUNDED]
    with pytest.raises(ValueError, match="prompt_indices must be in"):
        ServeConfig(configs=ONE, prompt_indices=[len(PROMPTS)])
