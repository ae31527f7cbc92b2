"""An episode's environment messages as the chat template's suffix tokens (`chat.ChatTurns`), on real
templates: the builtin tiny model's, SmolLM2's, and the Qwen3 template vLLM ships (MiniCPM-V 4.5's,
which is Qwen3's), which rewrites earlier turns and must be refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm

from m2po_cli.builtin_models import char_tokenizer
from m2po_cli.chat import ChatTurns, TemplateError, first_difference
from m2po_cli.models import load_tokenizer, resolve_model

QWEN3_TEMPLATE = Path(vllm.__file__).parent / "transformers_utils/chat_templates/template_minicpmv45.jinja"
SMOLLM2 = "builtin:smollm2-135m-instruct"


def conversation(tokenizer, messages, generation_prompt):
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
        )["input_ids"]
    )


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(resolve_model(SMOLLM2))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_suffix_extends_a_conversation_exactly_boundary_included(model, smollm2):
    # The whole conversation rendered at once equals: its model turn's tokens up to the end-of-turn
    # token, then the suffix. ChatML's newline after <|im_end|> is in the suffix (dropping it is a
    # known bug of other tools).
    tokenizer = char_tokenizer() if model == "tiny" else smollm2
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = ChatTurns(tokenizer, [eot], model)
    chat.check()
    for reply in ([{"role": "tool", "content": "42"}], [{"role": "user", "content": "Wrong, try again."}]):
        history = [{"role": "user", "content": "6*7"}, {"role": "assistant", "content": "\\boxed{41}"}]
        whole = conversation(tokenizer, history + reply, generation_prompt=True)
        head = conversation(tokenizer, history[:1], generation_prompt=True)
        end = whole.index(eot, len(head))
        suffix = chat.suffix(reply)
        assert whole[end + 1 :] == suffix
        text = tokenizer.decode(suffix)
        assert text.startswith("\n<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(smollm2):
    tokenizer = load_tokenizer(resolve_model(SMOLLM2))
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    with pytest.raises(TemplateError) as e:
        ChatTurns(tokenizer, [tokenizer.eos_token_id], "qwen3-template").check()
    message = str(e.value)
    assert "\n" not in message
    assert "qwen3-template rewrites earlier turns when a tool message is appended" in message
    assert "token 12" in message  # '<' of the <think> block the last turn had and an earlier one loses


def test_a_template_that_never_ends_the_model_turn_is_refused(char_tokenizer):
    with pytest.raises(TemplateError, match=r"does not end an assistant turn with an end-of-turn token"):
        ChatTurns(char_tokenizer, [0], "no-eot").check()  # id 0 (<unk>) is never written


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_dry_run_refuses_the_template_with_exit_2_naming_it(tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    from tests.conftest import QUICKSTART

    folder = tmp_path / "qwen3-template"
    shutil.copytree(resolve_model("builtin:tiny-qwen3-untied"), folder)
    for side in folder.glob("*.jinja"):
        side.unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    sets = [f'model.path="{folder}"', 'env.name="builtin:retry"']
    args = [sys.executable, "-m", "m2po_cli", "train", str(QUICKSTART), "--dry-run"]
    proc = subprocess.run(
        [*args, *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert f"the chat template of {folder} rewrites earlier turns when a tool message is appended" in line
    assert proc.stdout == ""
