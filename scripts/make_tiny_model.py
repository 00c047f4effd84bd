"""Write a tiny, weightless model directory for the Dynamo mocker engine.

Usage: python scripts/make_tiny_model.py <output-dir>

The directory holds what Dynamo reads to serve a model card offline:
- ``config.json``: a tiny llama architecture (no weights are ever loaded by the mocker);
- ``tokenizer.json``: a word-level tokenizer built with the ``tokenizers`` package. Prompts are
  split into single characters (so distinct prompts have distinct token ids and prefix caching is
  meaningful); ids above the character range decode to filler words. The mocker emits random
  token ids up to ~2000, so the vocabulary has ~32k entries or replies decode to empty text;
- ``tokenizer_config.json`` with a ``chat_template`` (and ``special_tokens_map.json``).

Runs in the Dynamo virtual environment (which has ``tokenizers``); needs no network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 32000
SPECIALS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> Tokenizer:
    vocab: dict[str, int] = {}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    for code in range(0x20, 0x7F):  # printable ASCII, one token per character
        vocab[chr(code)] = len(vocab)
    vocab["\n"] = len(vocab)
    filler = 0
    while len(vocab) < VOCAB_SIZE:  # filler words carry their own trailing space
        vocab[f"w{filler} "] = len(vocab)
        filler += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(model_config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 64}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
