"""The tokenizer against HF: incremental detokenisation (tokenizers' DecodeStream vs the Python window it replaced,
and the byte table) and chat templates rendered as transformers renders them.

A failure in the detokeniser tests means streamed text differs from the text of the whole answer, or from what
the window method streamed before DecodeStream (a changed delta, a split or lost multi-byte character, a dropped
tail at flush, a special token leaking). A failure in the template tests means a prompt differs from the one HF
builds for the same messages (a Llama-3-style template with ``bos_token``, a system message, headers,
``add_generation_prompt``, ``tojson`` and ``strftime_now``; ChatML), or a template's ``raise_exception`` is not a
client error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models.llama.chat_template import TemplateRefused
from models.llama.tokenizer import ChatTokenizer
from mstar_dist.tools.gguf_import import DEFAULT_SMOLLM2_DIR, default_smollm2_gguf, ensure_smollm2_weights

TEXT = """The quick brown fox jumps over the lazy dog; naïve café owners say “déjà vu” at the façade.
Übergrößenträger müssen die Straße überqueren, während Jürgen Käse isst.
Съешь же ещё этих мягких французских булок, да выпей чаю.
Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. مرحبا بالعالم، كيف حالك اليوم؟ नमस्ते दुनिया, आप कैसे हैं?
东京是日本的首都，人口超过一千三百万。我喜欢吃饺子和包子。 東京は日本の首都です。お寿司が大好きです。
안녕하세요 세계! 오늘 날씨가 정말 좋네요. 🚀🎉 👩‍👩‍👧‍👦 🇫🇷 ✓ ∑∫√∞ ≤ ≥ ≠ ½ ¾ € £ ¥ ₹
def fibonacci(n: int) -> int:
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # O(φⁿ)
Numbers 0123456789 and a tab\tthen    spaces, then "quotes" and 'apostrophes' and <tags/>.
"""
"""Varied text (accented Latin, Cyrillic, Greek, Arabic, Devanagari, CJK, Hangul, emoji with joiners, maths, code)."""


def sentencepiece_style(text: str, out_dir: Path) -> ChatTokenizer:
    """A Llama-2-layout tokenizer (``▁`` for spaces, BPE with <0xNN> byte fallback) trained on ``text``, written
    as an HF-layout tokenizer directory and loaded as a ChatTokenizer (its decoder is not ByteLevel)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
                                  limit_alphabet=150, show_progress=False)
    tok.train_from_iterator([text] * 4, trainer=trainer)
    # the byte tokens are vocabulary, not special: a decode that skips special tokens must keep them
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "unk_token": "<unk>"}))
    return ChatTokenizer(out_dir)


MULTILINGUAL = TEXT + "Ende: ß, é, 中, 🎉, 👩‍👩‍👧‍👦."


@pytest.fixture(scope="module")
def weights() -> Path:
    try:
        default_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ensure_smollm2_weights(DEFAULT_SMOLLM2_DIR, progress=lambda _: None)


@pytest.fixture(scope="module")
def smol(weights) -> ChatTokenizer:
    return ChatTokenizer(weights)


@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> ChatTokenizer:
    return sentencepiece_style(TEXT, tmp_path_factory.mktemp("sp"))


def streamed(tok: ChatTokenizer, ids: list[int], method: str | None = None) -> list[str]:
    decoder = tok.incremental_decoder(method=method)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# ------------------------------------------------------------------------------------------------ detokenisation


def test_default_methods_byte_table_for_byte_level_decode_stream_otherwise(smol, sp):
    assert smol.incremental_decoder().method == "bytes"
    assert sp.incremental_decoder().method == "stream"
    with pytest.raises(ValueError, match="'bytes' for byte-level BPE"):
        sp.incremental_decoder(method="bytes")


@pytest.mark.parametrize("which", ["smol", "sp"])
def test_decode_stream_deltas_equal_the_window_methods_byte_for_byte(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode(MULTILINGUAL)
    window, stream = streamed(tok, ids, "window"), streamed(tok, ids, "stream")
    assert stream == window  # every delta, not only the joined text
    assert "".join(stream).encode() == tok.decode(ids).encode()
    assert "" in stream[:-1]  # some ids end mid-character and were held back
    assert not any("\ufffd" in d for d in stream)
    if which == "smol":
        assert "".join(streamed(tok, ids, "bytes")) == "".join(stream)
    else:
        assert any(tok._tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback was exercised


@pytest.mark.parametrize("which", ["smol", "sp"])
def test_a_tail_cut_mid_character_flushes_the_same_replacement(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode("ok 東")
    for cut in range(1, len(ids) + 1):
        expected = streamed(tok, ids[:cut], "window")
        assert streamed(tok, ids[:cut], "stream") == expected
        assert "".join(expected) == tok.decode(ids[:cut])


def test_special_tokens_are_skipped_by_every_method(smol, sp):
    for tok, methods in ((smol, ("bytes", "stream", "window")), (sp, ("stream", "window"))):
        eos = tok._tok.token_to_id(tok.eos_token)
        ids = [*tok.encode("Paris, ça va."), eos]
        for method in methods:
            assert "".join(streamed(tok, ids, method)) == "Paris, ça va."
            assert "".join(tok.incremental_decoder(skip_special_tokens=False, method=method).push(ids)) \
                .endswith(tok.eos_token)


def test_a_refused_decode_stream_window_falls_back_to_the_python_window(sp):
    ids = sp.encode(MULTILINGUAL)
    decoder = sp.incremental_decoder(method="stream")
    real, calls = decoder._stream, []

    class Refusing:
        def step(self, tokenizer, token_id):
            calls.append(token_id)
            if len(calls) > 40:
                raise Exception("Invalid prefix encountered")
            return real.step(tokenizer, token_id)

    decoder._stream = Refusing()
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert len(calls) == 41 and decoder._stream is None
    assert deltas == streamed(sp, ids, "window")


# ------------------------------------------------------------------------------------------------ chat templates

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{%- if tools is not none %}{{- tools | tojson(indent=4) }}{%- endif %}\n"
    "{{- 'Conversation so far: ' + messages | tojson + '\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported after the system message!') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['content'] == '<stop>' %}{% break %}{% endif %}\n"
    "    {%- if message['content'] == '' %}{% continue %}{% endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Réponds en français, s'il te plaît. <b>&</b>  "},
     {"role": "user", "content": "Où est « la tour Eiffel » ? 🗼"},
     {"role": "assistant", "content": "À Paris."},
     {"role": "user", "content": "Und auf Deutsch? 日本語でも。"}],
    [{"role": "user", "content": "skip the empty one"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "last"}, {"role": "user", "content": "<stop>"},
     {"role": "user", "content": "never rendered"}],
]


def with_template(weights: Path, tmp_path: Path, template: str | None):
    """(our ChatTokenizer, HF's PreTrainedTokenizerFast) over the same tokenizer.json, special tokens and
    ``template`` (None: the one SmolLM2 ships, ChatML)."""
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((weights / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = template
    shutil.copy(weights / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                              **{k: cfg[k] for k in ("bos_token", "eos_token", "unk_token",
                                                                     "pad_token")})
    hf.chat_template = cfg["chat_template"]
    return ChatTokenizer(tmp_path), hf


@pytest.mark.parametrize("template", ["llama3", "chatml", "smollm2"])
def test_templates_render_exactly_as_transformers(weights, tmp_path, template):
    source = {"llama3": LLAMA3, "chatml": CHATML, "smollm2": None}[template]
    ours, hf = with_template(weights, tmp_path, source)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert got == want
    if template == "llama3":
        assert got.startswith("<|im_start|><|start_header_id|>system<|end_header_id|>\n\n")  # bos_token first
        assert "Today Date: " in got and "never rendered<|eot_id|>" not in got  # {% break %} ended the loop


def test_tojson_keeps_unicode_and_key_order_and_the_template_sees_no_html_escaping(weights, tmp_path):
    ours, _ = with_template(weights, tmp_path, LLAMA3)
    text = ours.apply_chat_template(CONVERSATIONS[1])
    assert '[{"role": "user", "content": "Où est « la tour Eiffel » ? 🗼"}' in text
    assert "<b>&</b>" in text


def test_raise_exception_is_a_template_error_and_a_client_error(weights, tmp_path):
    import jinja2

    ours, hf = with_template(weights, tmp_path, LLAMA3)
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]
    with pytest.raises(jinja2.TemplateError, match="Only user and assistant roles") as want:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TemplateRefused, match="Only user and assistant roles") as got:
        ours.apply_chat_template(messages)
    assert isinstance(got.value, ValueError) and str(got.value) == str(want.value)


def test_an_intake_encodes_prompts_as_the_conductor_would_without_importing_torch(weights) -> None:
    """HTTP intake processes tokenize in place of the conductor (``CompositeModel.prompt_encoder``): the ids must be
    those ``LlamaChat.preprocess`` computes, for chat messages and raw prompts, and building the encoder must not
    import torch (an intake loads none). A family that shapes its prompts itself (Orpheus) offers no encoder."""
    import subprocess
    import sys

    from models.llama.chat import SmolLM2Chat
    from models.speech.orpheus import OrpheusSpeech  # shapes its prompts: no encoder (checked below)
    from mstar_dist.runtime.registry import load_prompt_encoder
    from mstar_dist.graph.model import RequestState
    from mstar_dist.transport.inline import decode_tensor

    family = SmolLM2Chat(str(weights))
    family.load_frontend()
    spec = family.prompt_encoder()
    encoder = load_prompt_encoder(spec)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, ß 中 🎉"}]
    for prompt, msgs in ((None, messages), ("Once upon a time", None)):
        state = RequestState(request_id="r", seed=0, max_tokens=8)
        family.preprocess(state, prompt, msgs)
        ids = encoder.encode_prompt(prompt, msgs)
        assert decode_tensor(state.data["input_ids"]).tolist() == ids and len(ids) > 3
        given = RequestState(request_id="r", seed=0, max_tokens=8, data={"prompt_ids": ids})
        family.preprocess(given, "ignored when ids are given", None)
        assert given.data["input_ids"] == state.data["input_ids"]
    module = spec[0].partition(":")[0]
    code = (f"import sys, {module}; from mstar_dist.runtime.registry import load_prompt_encoder; "
            f"load_prompt_encoder({spec!r}); assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr

    class Shaped(SmolLM2Chat):  # as Orpheus does: its own prompt layout
        def preprocess(self, state, prompt, messages):
            super().preprocess(state, f"[voice] {prompt}", None)

    assert Shaped(str(weights)).prompt_encoder() is None and load_prompt_encoder(None) is None
    assert OrpheusSpeech.preprocess is not SmolLM2Chat.preprocess


def test_prompt_ids_encoded_piece_by_piece_are_the_whole_texts(weights, tmp_path):
    """``encode_prompt`` cuts the text at the added tokens and remembers each piece's ids: for any text, including
    added tokens a client wrote, adjacent ones and the whitespace beside them, the ids must be those of the whole
    text, the second time as the first; and a tokenizer whose added tokens take in the whitespace around them must
    get the whole text's ids too (it encodes whole)."""
    smol = ChatTokenizer(weights)
    added = sorted(t.content for t in smol._tok.get_added_tokens_decoder().values())
    texts = [
        "plain text, no added token",
        " ".join(added) + "".join(added),
        f"{added[1]}{added[2]} x {added[0]}\n\n  {added[-1]}digits 12345 and 3.14",
        MULTILINGUAL,
        "<|im_start|user <|im_end> |im_start|>",  # near misses
    ]
    for text in texts:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": text + " ?"}]
        whole = smol.encode(smol.apply_chat_template(messages))
        assert smol.encode_prompt(None, messages) == whole == smol.encode_prompt(None, messages)
        assert smol.encode_prompt(text, None) == smol.encode(text)

    config = json.loads((weights / "tokenizer.json").read_text())
    for token in config["added_tokens"]:
        token["lstrip"] = token["rstrip"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (weights / name).is_file():
            shutil.copy(weights / name, tmp_path / name)
    stripping = ChatTokenizer(tmp_path)
    text = f"a {added[1]} b\n{added[2]}\n c"
    assert stripping.encode_prompt(text, None) == stripping.encode(text) != smol.encode(text)
