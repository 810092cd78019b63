"""A saved model with a head is that head wherever it is opened, or refused: each test runs the way a user's process
would, in a fresh interpreter that imports only what the user imports.

The model: a tiny Llama over the project's byte-level BPE whose eos logit is held low (the softmax of its logits
rarely picks eos: a plain decoding runs on), with the NMST head at ε = 0.2 (greedy NMST emits eos by t½ = 4),
saved with ``save_pretrained`` (the NMST checkpoint type) and its tokenizer beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import nmst_fast
from nmst_fast.integrations.hf import apply_nmst, export_plain

from hf_models import bpe_tokenizer, tiny_llama

EPS = 0.2
T_HALF = nmst_fast.termination_bound(EPS)
PROMPTS = [" The river", " In the town of", " He said that the", " A"]
# Run first in a process that is told nmst-fast is not installed: its import fails as a missing package's does.
NOT_INSTALLED = '''
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "nmst_fast" or name.startswith("nmst_fast."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NotInstalled())
'''


def run_user(code: str, *, nmst_fast_installed: bool = True, timeout: int = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (no terminal: transformers' trust_remote_code prompt is answered "no")."""
    source = (NOT_INSTALLED if not nmst_fast_installed else "") + textwrap.dedent(code)
    variables = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **(env or {}))
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=variables)


def last_json(done: subprocess.CompletedProcess):
    """The JSON the user code printed after ``RESULT `` (transformers may print a prompt on the same line)."""
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """"nmst": the model with its head as save_pretrained writes it; "old": the same as nmst-fast 0.1 wrote it
    (the base model's type, the head in an entry plain tools ignore); "plain": ``export_plain`` of "nmst"."""
    root = tmp_path_factory.mktemp("portable")
    tokenizer = bpe_tokenizer()
    model = apply_nmst(tiny_llama(tokenizer, seed=3, eos_offset=-8.0, dtype=torch.float32), head="nmst", eps=EPS)
    model.save_pretrained(root / "nmst")
    tokenizer.save_pretrained(root / "nmst")
    old = root / "old"
    shutil.copytree(root / "nmst", old, ignore=shutil.ignore_patterns("nmst_checkpoint.py"))
    config = json.loads((old / "config.json").read_text())
    config["model_type"] = config.pop("base_model_type")
    config["architectures"] = ["LlamaForCausalLM"]
    del config["auto_map"]
    (old / "config.json").write_text(json.dumps(config))
    export_plain(root / "nmst", root / "plain")
    return {"nmst": root / "nmst", "old": old, "plain": root / "plain"}


GREEDY = '''
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({dir!r})
model = AutoModelForCausalLM.from_pretrained({dir!r}{load})
runs = []
for prompt in {prompts!r}:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    runs.append(out[0, ids.shape[1]:].tolist())
print("RESULT " + json.dumps(dict(runs=runs, eos=tokenizer.eos_token_id, cls=type(model).__name__)))
'''


def greedy_runs(directory: Path, *, prefix: str = "", load: str = "") -> dict:
    return last_json(run_user(prefix + GREEDY.format(dir=str(directory), load=load, prompts=PROMPTS)))


def assert_the_head_stops(result: dict) -> None:
    """Every greedy run ends with eos by t½, as greedy NMST must."""
    for run in result["runs"]:
        assert result["eos"] in run and run.index(result["eos"]) < T_HALF, run


def test_the_plain_export_runs_on_where_the_head_stops(saved):
    """The contrast every test below relies on: the softmax of this model's logits does not stop."""
    plain = greedy_runs(saved["plain"])
    assert plain["cls"] == "LlamaForCausalLM"
    assert all(plain["eos"] not in run[:T_HALF] for run in plain["runs"]), plain


def test_from_pretrained_without_nmst_fast_imported_refuses(saved):
    done = run_user(f"""
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained({str(saved['nmst'])!r})
        """)
    assert done.returncode != 0 and "trust_remote_code=True" in done.stderr, done.stderr[-2000:]


def test_from_pretrained_after_import_nmst_fast_decodes_the_head(saved):
    result = greedy_runs(saved["nmst"], prefix="import nmst_fast\n")
    assert result["cls"] == "NMSTLlamaForCausalLM"
    assert_the_head_stops(result)


def test_from_pretrained_with_trust_remote_code_decodes_the_head(saved):
    assert_the_head_stops(greedy_runs(saved["nmst"], load=", trust_remote_code=True"))


def test_without_nmst_fast_installed_trust_remote_code_names_the_package(saved):
    done = run_user(f"""
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained({str(saved['nmst'])!r}, trust_remote_code=True)
        """, nmst_fast_installed=False)
    assert done.returncode != 0 and "nmst_fast" in done.stderr and "pip install" in done.stderr, done.stderr[-2000:]


def test_apply_nmst_greedy_and_sampled_generate_stop(saved):
    """The row of ``apply_nmst(model)`` then ``generate()``, greedy and sampled: no flag needed."""
    result = last_json(run_user(f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from nmst_fast.integrations.hf import apply_nmst
        tokenizer = AutoTokenizer.from_pretrained({str(saved['nmst'])!r})
        model = apply_nmst(AutoModelForCausalLM.from_pretrained({str(saved['nmst'])!r}))
        ids = tokenizer({PROMPTS!r}[1], return_tensors="pt").input_ids.expand(50, -1)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=100, do_sample=True, top_k=0, pad_token_id=tokenizer.eos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        greedy = model.generate(ids[:1], max_new_tokens=100, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        n = ids.shape[1]
        print("RESULT " + json.dumps(dict(sampled=sampled[:, n:].tolist(), greedy=greedy[0, n:].tolist(),
                                          eos=tokenizer.eos_token_id)))
        """))
    eos = result["eos"]
    assert eos in result["greedy"] and result["greedy"].index(eos) < T_HALF
    # Past t½ p(eos) >= 1/2 at every step: all 50 draws stop long before 100 tokens.
    assert all(eos in run for run in result["sampled"])


@pytest.mark.slow
def test_pipeline_by_path(saved):
    code = textwrap.dedent(f"""
        import json
        from transformers import pipeline
        generator = pipeline("text-generation", model={str(saved['nmst'])!r}{{load}})
        outs = generator({PROMPTS!r}, max_new_tokens=30, do_sample=False, return_tensors=True)
        print("RESULT " + json.dumps([out[0]["generated_token_ids"] for out in outs]))
        """)
    refused = run_user(code.format(load=""))
    assert refused.returncode != 0 and "trust_remote_code=True" in refused.stderr, refused.stderr[-2000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(saved["nmst"])
    for prefix, load in (("import nmst_fast\n", ""), ("", ", trust_remote_code=True")):
        runs = last_json(run_user(prefix + code.format(load=load)))
        lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
        assert_the_head_stops(dict(runs=[run[n:] for run, n in zip(runs, lengths)], eos=tokenizer.eos_token_id))


@pytest.mark.slow
def test_a_checkpoint_of_nmst_fast_0_1_opens_with_its_head_and_upgrades(saved, tmp_path):
    """Opened where nmst_fast is imported: the recorded head, with a warning naming the upgrade command, which
    rewrites config.json (the weights untouched) so that a process without the import refuses it."""
    old = tmp_path / "old"
    shutil.copytree(saved["old"], old)
    done = run_user("import nmst_fast\n" + GREEDY.format(dir=str(old), load="", prompts=PROMPTS))
    assert_the_head_stops(last_json(done))
    assert f"nmst-fast upgrade {old}" in done.stderr
    weights = (old / "model.safetensors").read_bytes()
    upgraded = subprocess.run([Path(sys.executable).with_name("nmst-fast"), "upgrade", str(old)],
                              capture_output=True, text=True, timeout=120)
    assert upgraded.returncode == 0 and "upgraded" in upgraded.stdout, upgraded.stderr
    assert (old / "model.safetensors").read_bytes() == weights
    assert json.loads((old / "config.json").read_text())["model_type"] == "nmst"
    refused = run_user(f"from transformers import AutoModelForCausalLM\n"
                       f"AutoModelForCausalLM.from_pretrained({str(old)!r})")
    assert refused.returncode != 0 and "trust_remote_code=True" in refused.stderr
    assert_the_head_stops(greedy_runs(old, prefix="import nmst_fast\n"))


@pytest.mark.slow
def test_export_plain_says_what_it_gives_up(saved, tmp_path):
    done = subprocess.run([Path(sys.executable).with_name("nmst-fast"), "export-plain", str(saved["nmst"]),
                           str(tmp_path / "plain")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "NOT the head's distribution" in done.stdout, done.stderr
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["nmst_head_removed"]["head"] == "nmst" and "nmst" not in config
    again = subprocess.run([Path(sys.executable).with_name("nmst-fast"), "export-plain", str(saved["old"]),
                            str(tmp_path / "plain2")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "nmst-fast upgrade" in again.stderr


def test_mlx_lm_refuses_the_checkpoint(saved):
    pytest.importorskip("mlx_lm", reason="mlx-lm runs on Linux and macOS (the test extra installs it there)")
    code = """
        from pathlib import Path
        from mlx_lm.utils import load_model
        load_model(Path({dir!r}))
        print("loaded")
        """
    refused = run_user(code.format(dir=str(saved["nmst"])))
    assert refused.returncode != 0 and "Model type nmst not supported" in refused.stderr, refused.stderr[-2000:]
    assert run_user(code.format(dir=str(saved["plain"]))).stdout.strip().endswith("loaded")  # the base model loads


def test_a_reloaded_model_trains_its_head_under_peft_and_hf_trainer(saved, tmp_path):
    """PEFT's LoRA on the loaded model trains the head's loss; its adapter saved and opened on the saved model
    again decodes the head; HF Trainer's step on the loaded model is the head's loss."""
    from peft import LoraConfig, get_peft_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(saved["nmst"])
    base = transformers.AutoModelForCausalLM.from_pretrained(saved["nmst"])
    ids = tokenizer([" The river flows past the stone"], return_tensors="pt").input_ids
    labels = ids.clone()
    want = base(ids, labels=labels).loss  # the head's fused loss
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    torch.testing.assert_close(peft_model(input_ids=ids, labels=labels).loss, want)
    plain = transformers.AutoModelForCausalLM.from_pretrained(saved["plain"])
    assert abs(float(plain(ids, labels=labels).loss) - float(want)) > 0.05  # the softmax's loss is another
    peft_model.save_pretrained(tmp_path / "adapter")
    result = last_json(run_user(f"""
        import json, nmst_fast
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(saved['nmst'])!r})
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(saved['nmst'])!r}),
                                          {str(tmp_path / 'adapter')!r})
        runs = []
        for prompt in {PROMPTS!r}:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False)
            runs.append(out[0, ids.shape[1]:].tolist())
        print("RESULT " + json.dumps(dict(runs=runs, eos=tokenizer.eos_token_id)))
        """))
    assert_the_head_stops(result)
    # HF Trainer on the model loaded from the directory: its first step's logged loss is the head's loss.
    from datasets import Dataset

    model = transformers.AutoModelForCausalLM.from_pretrained(saved["nmst"])
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=1, learning_rate=1e-9,
                                          per_device_train_batch_size=1, logging_steps=1, report_to="none",
                                          save_strategy="no", use_cpu=True, dataloader_num_workers=0)
    data = Dataset.from_dict(dict(input_ids=ids.tolist(), labels=labels.tolist()))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(float(want), rel=1e-5)


TRL_SFT = '''
import json, torch
{imports}
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({dir!r})
data = Dataset.from_dict(dict(text=[" The river flows past the stone and the reed",
                                    " In the town of the bells the people buy bread"] * 2))
config = SFTConfig(output_dir={out!r}, max_steps=1, per_device_train_batch_size=4, report_to="none",
                   logging_steps=1, save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0, bf16=False,
                   learning_rate=1e-9, model_init_kwargs=dict(dtype=torch.float32{load}))
trainer = SFTTrainer(model={model}, args=config, train_dataset=data, processing_class=tokenizer)
trainer.train()
print("RESULT " + json.dumps(trainer.state.log_history[0]["loss"]))
'''


@pytest.mark.slow
def test_trl_sft_trains_the_head_given_the_path_or_the_loaded_model(saved, tmp_path):
    """SFTTrainer's first-step loss on the saved model is the head's, given its path (after import nmst_fast, or
    with trust_remote_code in model_init_kwargs) or the loaded model; the plain export's is the softmax's; given
    the path with neither, the model is refused."""
    def loss(directory, imports="", model=None, load=""):
        code = TRL_SFT.format(imports=imports, dir=str(directory), out=str(tmp_path / "out"), load=load,
                              model=model or repr(str(directory)))
        return last_json(run_user(code, timeout=600))

    loaded = ("from transformers import AutoModelForCausalLM",
              f"AutoModelForCausalLM.from_pretrained({str(saved['nmst'])!r})")
    by_path = loss(saved["nmst"], imports="import nmst_fast")
    by_model = loss(saved["nmst"], imports="import nmst_fast\n" + loaded[0], model=loaded[1])
    trusted = loss(saved["nmst"], load=", trust_remote_code=True")
    explicit = loss(saved["plain"], imports="from nmst_fast.integrations.hf import apply_nmst\n" + loaded[0],
                    model=f"apply_nmst(AutoModelForCausalLM.from_pretrained({str(saved['plain'])!r}), head='nmst', "
                          f"eps={EPS})")
    plain = loss(saved["plain"])
    assert by_path == pytest.approx(explicit, rel=1e-6) == by_model == trusted
    assert abs(plain - explicit) > 0.05
    refused = run_user(TRL_SFT.format(imports="", dir=str(saved["nmst"]), out=str(tmp_path / "out"), load="",
                                      model=repr(str(saved["nmst"]))), timeout=600)
    assert refused.returncode != 0 and "trust_remote_code=True" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_lm_evals_hf_model_refuses_and_points_at_nmst(saved, tmp_path):
    """lm-eval's own ``--model hf`` on the saved model: refused by transformers (custom code) or, with
    trust_remote_code, by the head (evaluate with --model nmst); the plain export is evaluated."""
    from test_lm_eval import TASK, write_task

    include = write_task(tmp_path / "tasks", [" The river flows past the stone.<|endoftext|>"])

    def lm_eval(directory, extra=""):
        command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                   f"pretrained={directory},dtype=float32{extra}", "--tasks", TASK, "--include_path", str(include),
                   "--device", "cpu", "--batch_size", "1", "--output_path", str(tmp_path / "out")]
        return subprocess.run(command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                                       HF_HOME=str(tmp_path / "hf")), cwd=tmp_path)

    refused = lm_eval(saved["nmst"])
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr, refused.stderr[-3000:]
    pointed = lm_eval(saved["nmst"], ",trust_remote_code=True")
    assert pointed.returncode != 0 and "--model nmst" in pointed.stderr, pointed.stderr[-3000:]
    assert lm_eval(saved["plain"]).returncode == 0


@pytest.mark.slow
def test_llama_cpps_converter_refuses_the_checkpoint(saved, tmp_path):
    """llama.cpp's HF→GGUF converter (from the llama-cpp-python sdist that NMST_LLAMA_CPP_SDIST names; .ci/run
    downloads it) picks its code by ``architectures[0]``: NMSTLlamaForCausalLM is not one of its models."""
    import tarfile

    sdist = os.environ.get("NMST_LLAMA_CPP_SDIST")
    if not sdist:
        pytest.skip("set NMST_LLAMA_CPP_SDIST to a llama-cpp-python sdist (.ci/run downloads 0.3.36)")
    with tarfile.open(sdist) as archive:
        wanted = [f"/vendor/llama.cpp/{part}" for part in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")]
        members = [m for m in archive.getmembers() if any(part in m.name for part in wanted)]
        archive.extractall(tmp_path, members=members, filter="data")
    (converter,) = tmp_path.rglob("convert_hf_to_gguf.py")
    done = subprocess.run([sys.executable, str(converter), str(saved["nmst"]), "--outfile", str(tmp_path / "m.gguf")],
                          capture_output=True, text=True, timeout=300, cwd=converter.parent)
    assert done.returncode != 0 and "NMSTLlamaForCausalLM is not supported" in done.stderr + done.stdout, \
        (done.stdout + done.stderr)[-3000:]
    assert not (tmp_path / "m.gguf").exists()
