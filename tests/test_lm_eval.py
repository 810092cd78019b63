"""lm-eval's model "nmst" (nmst_fast.integrations.lm_eval): every request type equals a float64
reference built from the unpatched model's own logits and ``nmst_log_probs`` (t = 1 at the first
scored token), for tiny random Llamas saved with their head and a byte-level BPE; head "va" equals
lm-eval's own HFLM; a local WikiText task's word perplexity equals the project's own evaluation."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM

from nmst_fast.data.bpe import EOS_TOKEN, encode_bpe_lines
from nmst_fast.data.wikitext import find_split_file, read_lines
from nmst_fast.integrations.hf import apply_nmst, has_head
from nmst_fast.integrations.lm_eval import NMSTLM
from nmst_fast.settings import HeadSettings

from hf_models import POSITIONS, bpe_tokenizer, head_log_probs, reference_nll, tiny_llama
from wikitext_text import generated_lines, real_wikitext_dir

REPO = Path(__file__).parents[1]

# --- builders: a BPE, tiny Llamas saved with their head, a local WikiText task --------------------

TASK = "nmst_wikitext_lines"


def wikitext_lines(split: str, count: int, *, real: bool = False) -> list[str]:
    """The first ``count`` non-empty lines of a WikiText split, stripped: generated WikiText-shaped text
    (``wikitext_text``), or the real WikiText-2 files (``real``; the test skips without NMST_WIKITEXT_DIR)."""
    if not real:
        return generated_lines(split, count)
    lines = [line.strip() for line in read_lines(find_split_file(real_wikitext_dir(), split)) if line.strip()]
    return lines[:count]


# Per head: the eos logit's offset (see tiny_llama) and ε; each head's model has its own seed.
HEADS = {"nmst": dict(eos_offset=-8.0, eps=5e-3), "st": dict(eos_offset=8.0, eps=5e-3),
         "va": dict(eos_offset=-8.0, eps=1e-5)}
SEEDS = {"nmst": 11, "st": 21, "va": 13, None: 14}


def save_model(directory: Path, tokenizer, head: Optional[str], *, seed: int) -> Path:
    """A tiny Llama saved with ``tokenizer`` in ``directory``: after ``apply_nmst(head, ε, context_length=1)``
    (config.json records them), or without a head when ``head`` is None (a plain model)."""
    settings = HEADS[head or "nmst"]
    model = tiny_llama(tokenizer, seed=seed, eos_offset=settings["eos_offset"])
    if head is not None:
        apply_nmst(model, head=head, eps=settings["eps"], context_length=1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_task(directory: Path, documents: list[str]) -> Path:
    """An lm-eval task ``nmst_wikitext_lines`` in ``directory`` (for ``--include_path``): one
    loglikelihood_rolling document per entry of ``documents``, from a local JSON-lines file."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = directory / "documents.jsonl"
    lines.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents), encoding="utf-8")
    (directory / f"{TASK}.yaml").write_text(textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {json.dumps(str(lines))}
          cache_dir: {json.dumps(str(directory / "datasets-cache"))}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        metadata:
          version: 1.0
        """), encoding="utf-8")
    return directory


def line_document(line: str) -> str:
    """A WikiText line as the project's training / evaluation sees it (``encode_bpe_lines``: " " + the
    stripped line, then eos), written as text: lm-eval's tokenizer reads ``<|endoftext|>`` as the eos id."""
    return " " + line.strip() + EOS_TOKEN


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    """head -> a saved model directory (model + tokenizer); None -> a model saved without a head."""
    root = tmp_path_factory.mktemp("lm_eval_models")
    return {head: save_model(root / str(head), tokenizer, head, seed=SEEDS[head])
            for head in ("nmst", "st", "va", None)}


def nmst_lm(directory: Path, **kwargs) -> NMSTLM:
    return NMSTLM(pretrained=str(directory), device="cpu", **{"batch_size": 3, **kwargs})


def plain_model(directory: Path):
    """The saved model as transformers loads it (with the head where nmst_fast registered its class), float64."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def base_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) the output layer's own logits: without the head's eos entry where the model has a head."""
    return model(ids, nmst_logits=False).logits if has_head(model) else model(ids).logits


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


# --- the float64 reference ----------------------------------------------------------------------

def reference_log_probs(model, context: list[int], continuation: list[int], head: str, eps: float,
                        temperature: float = 1.0) -> torch.Tensor:
    """(n, V) float64 head log-distribution at each of the continuation's n steps (t = 1..n) given the
    context, from the model's own logits of context + continuation[:-1]."""
    ids = torch.tensor([context + continuation[:-1]]) if continuation else torch.tensor([context])
    with torch.no_grad():
        logits = base_logits(model, ids)[:, len(context) - 1:].double()
    n = logits.shape[1]
    return head_log_probs(logits, head=head, eps=eps, eos=model.config.eos_token_id,
                          steps=torch.arange(1, n + 1)[None], temperature=temperature)[0]


def reference_loglikelihood(model, context, continuation, head, eps) -> tuple[float, bool]:
    log_p = reference_log_probs(model, context, continuation, head, eps)
    targets = torch.tensor(continuation)
    return float(log_p.gather(-1, targets[:, None]).sum()), bool((log_p.argmax(-1) == targets).all())


def reference_greedy(model, context, head, eps, steps, *, temperature=1.0, stop_at_eos=True) -> list[int]:
    """The head's greedy tokens after ``context`` (at most ``steps``; eos ends them, included)."""
    tokens: list[int] = []
    for _ in range(steps):
        log_p = reference_log_probs(model, context, tokens + [0], head, eps, temperature)  # last row: the next step
        tokens.append(int(log_p[-1].argmax()))
        if stop_at_eos and tokens[-1] == model.config.eos_token_id:
            break
    return tokens


def rolling_windows(tokens: list[int], prefix: int, length: int) -> list[tuple[list[int], int]]:
    """lm-eval 0.4.13's rolling windows (context_len=1), written out: (input ids, k) where the input's
    last k positions predict the next k document tokens. The first window predicts the first
    k = min(length, n) tokens from ``prefix`` + the first k - 1; each next one predicts up to
    ``length`` more from the ``length`` tokens before its last target."""
    done = min(length, len(tokens))
    windows = [([prefix] + tokens[: done - 1], done)]
    while done < len(tokens):
        end = min(done + length, len(tokens))
        windows.append((tokens[end - length - 1: end - 1], end - done))
        done = end
    return windows


def reference_rolling(model, tokens, prefix, length, head, eps, *, restart=False) -> float:
    """Σ log p of the document's tokens, each scored in its window, at t = 1..n along the document
    (ST's running sum along it); ``restart``: t and the sum restart in every window instead (wrong:
    the check that the test can tell them apart)."""
    rows = []
    with torch.no_grad():
        for ids, k in rolling_windows(tokens, prefix, length):
            rows.append(base_logits(model, torch.tensor([ids]))[0, -k:].double())
    eos = model.config.eos_token_id
    pieces = [torch.cat(rows)] if not restart else rows
    total, at = 0.0, 0
    for logits in pieces:
        n = logits.shape[0]
        nll = reference_nll(logits[None], torch.tensor([tokens[at:at + n]]), torch.arange(1, n + 1)[None], head=head,
                            eps=eps, eos=eos)
        total -= float(nll.sum())
        at += n
    return total


# --- the model registered, its settings --------------------------------------------------------

def test_nmst_is_a_registered_lm_eval_model():
    assert get_model("nmst") is NMSTLM
    assert issubclass(NMSTLM, HFLM)


def test_settings_come_from_config_and_model_args_only_fill_in(saved):
    lm = nmst_lm(saved["st"], head="st", eps=5e-3)  # agreeing with the record is fine
    assert lm.nmst == HeadSettings(head="st", eps=5e-3, eos_token_id=lm.tokenizer.eos_token_id)
    for clash in (dict(head="nmst"), dict(eps=1e-3), dict(eos_token_id=5)):
        with pytest.raises(ValueError, match="trained with"):
            nmst_lm(saved["st"], **clash)
    with pytest.raises(ValueError, match="--model hf"):
        nmst_lm(saved[None])
    with pytest.raises(ValueError, match="eps"):
        nmst_lm(saved[None], head="nmst")
    lm = nmst_lm(saved[None], head="nmst", eps=1e-3)
    assert lm.nmst == HeadSettings(head="nmst", eps=1e-3, eos_token_id=lm.tokenizer.eos_token_id)
    assert nmst_lm(saved[None], head="va").nmst.head == "va"


# --- loglikelihood --------------------------------------------------------------------------------

TEXT_REQUESTS = [(" The river flows", " past stone and reed"), (" In 2006 ,", " he starred in the play"),
                 ("", " Robert is an English film actor"), (" Bells ring out", " ."),
                 (" He had a guest role in the television series", " The Bill in 2000 , followed by more")]


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_loglikelihood_equals_the_float64_reference(saved, head):
    eps = HEADS[head]["eps"]
    lm, model = nmst_lm(saved[head]), plain_model(saved[head])
    got = lm.loglikelihood(requests("loglikelihood", TEXT_REQUESTS))
    for (context, continuation), (log_p, greedy) in zip(TEXT_REQUESTS, got):
        if context:
            context_ids, continuation_ids = lm._encode_pair(context, continuation)  # lm-eval's split of the text
        else:
            context_ids, continuation_ids = [lm.prefix_token_id], lm.tok_encode(continuation)
        want, want_greedy = reference_loglikelihood(model, context_ids, continuation_ids, head, eps)
        assert log_p == pytest.approx(want, rel=1e-10, abs=1e-10)
        assert greedy == want_greedy
    # is_greedy on token ids: the head's own greedy run (through its eos) is greedy, a change anywhere is not.
    eos = lm.tokenizer.eos_token_id
    cases = []
    for context in (" The river", " Robert <unk> is an English"):
        ids = lm.tok_encode(context)
        run = reference_greedy(model, ids, head, eps, 40)
        assert run[-1] == eos and len(run) > 4, "the model's greedy run should end with eos after a few tokens"
        second = int(reference_log_probs(model, ids, run, head, eps)[len(run) // 2].topk(2).indices[1])
        cases += [(ids, run), (ids, run[:-1] + [(eos + 1)]), (ids, run[: len(run) // 2] + [second])]
    got = lm._loglikelihood_tokens([(None, ids, run) for ids, run in cases])
    assert [greedy for _, greedy in got] == [True, False, False] * 2
    for (ids, run), (log_p, greedy) in zip(cases, got):
        want, want_greedy = reference_loglikelihood(model, ids, run, head, eps)
        assert (log_p, greedy) == (pytest.approx(want, rel=1e-10, abs=1e-10), want_greedy)


def test_float32_model_and_a_float64_softmax_dtype(saved):
    """HFLM's dtype loads the weights in float32; softmax_dtype runs the head's loss in float64 on them."""
    model = plain_model(saved["st"])
    (context, continuation), eps = TEXT_REQUESTS[-1], HEADS["st"]["eps"]
    for kwargs in (dict(dtype="float32"), dict(dtype="float32", softmax_dtype="float64")):
        lm = nmst_lm(saved["st"], **kwargs)
        assert lm.model.dtype == torch.float32
        assert lm._head.weight.dtype == (torch.float64 if "softmax_dtype" in kwargs else torch.float32)
        ((log_p, greedy),) = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
        want, want_greedy = reference_loglikelihood(model, *lm._encode_pair(context, continuation), "st", eps)
        assert (log_p, greedy) == (pytest.approx(want, rel=1e-5), want_greedy)


# --- loglikelihood_rolling ------------------------------------------------------------------------

@pytest.mark.parametrize("head", ["nmst", "st"])
def test_loglikelihood_rolling_carries_t_and_the_st_sum_across_windows(saved, head, tokenizer):
    eps, length = HEADS[head]["eps"], 16
    lm, model = nmst_lm(saved[head], max_length=length, batch_size=2), plain_model(saved[head])
    lines = wikitext_lines("test", 3)  # a heading, then two paragraphs: their first words
    documents = [" ".join(lines[1].split()[:24]), " ".join(lines[2].split()[:15]), lines[0], " Short ."]
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(doc,) for doc in documents]))
    windows = []
    for doc, log_p in zip(documents, got):
        tokens = lm.tok_encode(doc)
        windows.append(len(rolling_windows(tokens, lm.prefix_token_id, length)))
        want = reference_rolling(model, tokens, lm.prefix_token_id, length, head, eps)
        assert log_p == pytest.approx(want, rel=1e-10, abs=1e-10)
        if windows[-1] > 1:  # t (and ST's sum) restarting per window would be a different number
            assert abs(want - reference_rolling(model, tokens, lm.prefix_token_id, length, head, eps,
                                                restart=True)) > 1e-3
    assert max(windows) >= 3 and min(windows) == 1


# --- generate_until -------------------------------------------------------------------------------

def _until_inside(text: str, start: int = 3) -> tuple[str, int]:
    """A short ASCII string whose first occurrence in ``text`` is at index >= ``start``."""
    for i in range(start, len(text) - 1):
        piece = text[i:i + 2]
        if piece.isascii() and piece.isalnum() and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_generate_until_decodes_the_heads_greedy_and_sampling(saved, head):
    eps = HEADS[head]["eps"]
    lm, model = nmst_lm(saved[head], batch_size=4), plain_model(saved[head])
    decode = lm.tokenizer.decode
    contexts = [" The river flows past", " In 2006 , he", " Robert"]
    ids = [lm.tok_encode(c) for c in contexts]
    runs = [reference_greedy(model, i, head, eps, 40) for i in ids]
    eos = lm.tokenizer.eos_token_id
    assert all(run[-1] == eos for run in runs), "every greedy run should end with eos within 40 tokens"
    full = [decode(run[:-1]) for run in runs]
    stop, at = _until_inside(full[0])
    assert len(runs[1]) > 6
    args = [(contexts[0], dict(until=[stop], max_gen_toks=40)),  # cut at the stop string
            (contexts[1], dict(until=["\n\n"], max_gen_toks=6)),  # cut at max_gen_toks
            (contexts[2], dict(until=["\n\n"], max_gen_toks=40)),  # ends at the head's eos
            (contexts[1], dict(until=["\n\n"], max_gen_toks=40))]
    want = [full[0][:at], decode(runs[1][:6]), full[2], full[1]]
    # Sampling with top_k=1 draws the argmax of the head at temperature T (which divides the non-eos
    # logits only, so it moves where eos wins): a different run than T = 1's.
    hot = reference_greedy(model, ids[2], head, eps, 40, temperature=2.5)
    assert hot != runs[2]
    args.append((contexts[2], dict(until=["\n\n"], max_gen_toks=40, do_sample=True, temperature=2.5, top_k=1)))
    want.append(decode(hot[:-1] if hot[-1] == eos else hot))
    assert lm.generate_until(requests("generate_until", args)) == want


# --- va: lm-eval's own numbers --------------------------------------------------------------------

def test_head_va_gives_hflms_own_numbers(saved):
    ours, theirs = nmst_lm(saved["va"]), HFLM(pretrained=str(saved["va"]), device="cpu", batch_size=3)
    got, want = (lm.loglikelihood(requests("loglikelihood", TEXT_REQUESTS)) for lm in (ours, theirs))
    assert [g for _, g in got] == [g for _, g in want]
    assert [x for x, _ in got] == pytest.approx([x for x, _ in want], rel=1e-10)
    ids = ours.tok_encode(" The river")
    run = reference_greedy(plain_model(saved["va"]), ids, "va", 1e-5, 6, stop_at_eos=False)
    tokens = [(None, ids, run), (None, ids, run[:-1] + [(run[-1] + 1) % len(ours.tokenizer)])]
    got, want = (lm._loglikelihood_tokens(tokens) for lm in (ours, theirs))
    assert [g for _, g in got] == [g for _, g in want] == [True, False]
    assert [x for x, _ in got] == pytest.approx([x for x, _ in want], rel=1e-10)
    args = [(" The river", dict(until=["\n\n"], max_gen_toks=8)), (" Robert", dict(until=["\n\n"], max_gen_toks=8))]
    assert ours.generate_until(requests("generate_until", args)) == theirs.generate_until(
        requests("generate_until", args))
    ours = nmst_lm(saved["va"], max_length=16)
    theirs = HFLM(pretrained=str(saved["va"]), device="cpu", batch_size=3, max_length=16)
    documents = [(" ".join(line.split()[:20]),) for line in wikitext_lines("test", 3)]
    got, want = (lm.loglikelihood_rolling(requests("loglikelihood_rolling", documents)) for lm in (ours, theirs))
    assert got == pytest.approx(want, rel=1e-10)


# --- a WikiText task: word perplexity = the project's own evaluation ------------------------------

def project_word_perplexity(directory: Path, tokenizer, lines: list[str], documents: list[str]) -> float:
    """exp(summed NLL / words) with the NLL from the project's own evaluation, ``train.loop.token_perplexity``
    (the fused loss of the model as ``apply_nmst`` loads it with its recorded head).

    Like with like: the project scores a line as ``encode_bpe_lines`` tokenizes it (" " + line, eos)
    after its context; lm-eval scores every token of the document after its prefix token (here eos,
    the tokenizer's bos). So each sequence is the prefix token + the line's tokens, with a one-token
    context (t = 1 at the line's first token, as the model's recorded context_length = 1 says). The
    project has no word count of its own (its perplexity is per token); the words are lm-eval's:
    whitespace-separated fields of the document (the empty one before its leading space included)."""
    from train.loop import token_perplexity as perplexity

    eos = tokenizer.eos_token_id
    sequences = [[eos] + seq for seq in encode_bpe_lines(lines, tokenizer, min_tokens=1, max_tokens=POSITIONS)]
    assert len(sequences) == len(lines)
    model = apply_nmst(transformers.AutoModelForCausalLM.from_pretrained(directory)).eval()
    tokens = sum(len(seq) - 1 for seq in sequences)
    nll = math.log(perplexity(model, sequences, 1, 4096, eos, "cpu")) * tokens
    words = sum(len(re.split(r"\s+", doc)) for doc in documents)
    return math.exp(nll / words)


def wikitext_task(tmp_path: Path, tokenizer, count: int, *, real: bool = False) -> tuple[Path, list[str], list[str]]:
    """A local task over the first ``count`` WikiText test lines (see :func:`wikitext_lines`) that fit one
    lm-eval window."""
    lines = [line for line in wikitext_lines("test", 4 * count, real=real)
             if len(tokenizer(" " + line)["input_ids"]) + 1 <= POSITIONS][:count]
    documents = [line_document(line) for line in lines]
    return write_task(tmp_path / "tasks", documents), lines, documents


@pytest.mark.parametrize("real", [False, True], ids=["generated", "real-wikitext-2"])
@pytest.mark.parametrize("head", ["nmst"])
def test_word_perplexity_of_a_wikitext_task_equals_the_projects_evaluation(saved, tokenizer, tmp_path, head, real):
    """On WikiText-shaped text, and on the real WikiText-2 test lines where NMST_WIKITEXT_DIR names them."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    include, lines, documents = wikitext_task(tmp_path, tokenizer, 6, real=real)
    results = lm_eval.simple_evaluate(model="nmst", model_args=dict(pretrained=str(saved[head])), device="cpu",
                                      batch_size=4, tasks=[TASK],
                                      task_manager=TaskManager(include_path=str(include), include_defaults=False))
    got = results["results"][TASK]["word_perplexity,none"]
    assert got == pytest.approx(project_word_perplexity(saved[head], tokenizer, lines, documents), rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["st"])
def test_cli_runs_lm_eval_with_the_nmst_model(saved, tokenizer, tmp_path, head):
    """``python -m nmst_fast.integrations.lm_eval run --model nmst ...`` end to end: lm-eval's own CLI,
    a local task under --include_path, results written by lm-eval; offline (no hub)."""
    include, lines, documents = wikitext_task(tmp_path, tokenizer, 12)
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "nmst_fast.integrations.lm_eval", "run", "--model", "nmst",
               "--model_args", f"pretrained={saved[head]}", "--tasks", TASK, "--include_path", str(include),
               "--device", "cpu", "--batch_size", "4", "--output_path", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    (written,) = out.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["config"]["model"] == "nmst"
    got = results["results"][TASK]["word_perplexity,none"]
    assert got == pytest.approx(project_word_perplexity(saved[head], tokenizer, lines, documents), rel=1e-9)
