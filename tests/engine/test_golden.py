"""The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers a coding question coherently.

GOLDEN holds the first 40 greedy tokens our engine produced, inspected by hand when
recorded (the text below). mlx-lm, loading the same imported folder with its own loader
and model code, predicts every one of those tokens when fed the sequence (teacher forcing),
so the list is the model's answer, not an artefact of ours. When recorded, mlx-lm's
smallest top-1/top-2 logit margin over the 40 positions was 0.17 (logits span about ±45),
and it picked the same 40 tokens with its weights quantized and dequantized; the test uses
the dequantized float32 copy because quantized matmuls are slow on MLX's CPU backend.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.loading import load_model
from engine.tokenizer import Tokenizer

PROMPT = [{"role": "user",
           "content": "Write a Python function that checks if a number is prime."}]
GOLDEN = [
    3725, 5367, 198, 1604, 314, 79, 30921, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42,
    448, 1003, 4178, 472, 327, 2056, 281, 1845, 24, 34, 28, 464, 24, 94, 828, 32, 30, 37,
    25, 1232, 216, 33, 727,
]
GOLDEN_TEXT = (
    "```python\ndef is_prime(n):\n    if n < 2:\n        return False\n"
    "    for i in range(2, int(n**0.5) + 1):"
)


@pytest.mark.slow
def test_demo_model_greedy_answer(demo_model_dir: Path) -> None:
    target = load_model(demo_model_dir)
    events = list(ChatSession(target).generate(PROMPT, GenerateOptions(max_tokens=len(GOLDEN))))
    finished = events[-1]
    assert list(finished.token_ids) == GOLDEN
    assert finished.text == GOLDEN_TEXT
    assert "def is_prime" in finished.text
    assert finished.stats.finish_reason == "length"


@pytest.mark.slow
def test_golden_tokens_are_mlx_lms_greedy_choice(demo_model_dir: Path) -> None:
    from mlx_lm.utils import dequantize_model, load

    model, tokenizer = load(str(demo_model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    assert prompt == Tokenizer.from_folder(demo_model_dir).encode_chat(PROMPT)
    logits = model(mx.array([prompt + GOLDEN]))[0, len(prompt) - 1 : -1]
    assert mx.argmax(logits, axis=-1).tolist() == GOLDEN
