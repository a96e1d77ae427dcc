"""LoRA adapters per row (model.adapters) through real jobs: vLLM on CPU with two random LoRA
adapters made with PEFT on the tiny model. The proof is parity, row for row, with bare vLLM's
``LLM.generate`` given the same ``LoRARequest`` per prompt, and with transformers + PEFT in
float32 on every row; a base-model row batched with adapter rows runs on the base model (vLLM
0.32's CPU kernels gave it the last adapter when every LoRA slot was taken)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from pipelines import load_config, run_job
from pipelines.batchfile.run import run_batch_file
from pipelines.errors import ConfigError, JobError
from pipelines.plan.preflight import plan_job
from udfs.stages.prompts import PromptRenderer

from conftest import KV_CACHE, REPO, job_config

ADAPTERS = ("de", "fr")
# each title three times in a row: on the base model, then on each adapter (one block mixes
# all three), and two rows naming an adapter the job does not have
LANGS = (None, "de", "fr")
ROWS = [{"title": f"Lamp {i // 3}", "description": "A steel lamp, warm light.",
         "lang": LANGS[i % 3]} for i in range(24)]
ROWS += [{"title": "Lamp 99", "description": "A steel lamp.", "lang": "xx"}] * 2
MAX_TOKENS = 12


def _make_adapter(base: str, out, seed: int, rank: int = 8, targets=("q_proj", "v_proj")):
    """A random LoRA adapter for ``base`` (PEFT's format), its weights large enough that its
    outputs differ from the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=list(targets), lora_dropout=0.0,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, weight in peft.named_parameters():
            if "lora_" in name:
                weight.mul_(3.0)
    peft.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: _make_adapter(tiny_model, root / name, seed)
            for seed, name in enumerate(ADAPTERS, start=1)}


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora")
    (path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _config(tiny_model, adapters, root, out, **sections):
    base = {"model": {"adapters": adapters},
            "prompt": {"adapter_column": "lang"},
            "sampling": {"max_tokens": MAX_TOKENS}}
    sections = {**base, **{k: {**base.get(k, {}), **v} for k, v in sections.items()}}
    return job_config(tiny_model, root / "in.jsonl", root / out, **sections)


@pytest.fixture(scope="session")
def lora_job(tiny_model, adapters, root, ray_cluster):
    config = load_config(_config(tiny_model, adapters, root, "out"))
    plan = plan_job(config)
    summary = run_job(config)
    return plan, summary, pl.read_parquet(root / "out")


@pytest.fixture(scope="session")
def prompts(lora_job):
    """Each row's prompt token ids, as the job rendered them."""
    plan, _, _ = lora_job
    renderer = PromptRenderer(plan.render)
    return [renderer.render_row({k: row[k] for k in ("title", "description")})[0]
            for row in ROWS]


BARE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
job = json.load(open(sys.argv[1]))
llm = LLM(model=job["model"], dtype="float32", max_model_len=512, enforce_eager=True,
          kv_cache_memory_bytes=job["kv"], enable_chunked_prefill=False, enable_lora=True,
          max_lora_rank=8, max_loras=len(job["adapters"]) + 1)
lora = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(job["adapters"].items()))}
outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]],
                    SamplingParams(temperature=0, max_tokens=job["max_tokens"]),
                    lora_request=[lora[n] if n else None for n in job["names"]])
json.dump([{"text": o.outputs[0].text, "ids": list(o.outputs[0].token_ids)} for o in outs],
          open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="session")
def bare_vllm(tiny_model, adapters, prompts, root):
    """Bare vLLM's LLM.generate, a LoRARequest per prompt, in a process of its own."""
    runnable = [i for i, row in enumerate(ROWS) if row["lang"] != "xx"]
    job = {"model": tiny_model, "kv": KV_CACHE, "adapters": adapters,
           "max_tokens": MAX_TOKENS, "prompts": [prompts[i] for i in runnable],
           "names": [ROWS[i]["lang"] for i in runnable]}
    (root / "bare.json").write_text(json.dumps(job))
    run = subprocess.run([sys.executable, "-c", BARE, str(root / "bare.json"),
                          str(root / "bare_out.json")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(zip(runnable, json.loads((root / "bare_out.json").read_text())))


def test_each_row_runs_on_its_adapter_as_bare_vllm_and_peft_run_it(
        lora_job, bare_vllm, prompts, tiny_model, adapters):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, _, out = lora_job
    assert out.columns == ["title", "description", "lang", "row_id", "rewritten",
                           "finish_reason", "prompt_tokens", "completion_tokens", "error_kind",
                           "error", "request_key"]
    for i, reference in bare_vllm.items():
        assert out["rewritten"][i] == reference["text"], i
        assert out["completion_tokens"][i] == len(reference["ids"])
    # transformers + PEFT, float32, greedy: the same tokens on every row, base rows included
    models = {None: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), path)
    for i, reference in bare_vllm.items():
        ids = prompts[i]
        theirs = models[ROWS[i]["lang"]].generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, do_sample=False)[0][len(ids):].tolist()
        assert reference["ids"] == theirs, (i, ROWS[i]["lang"])
    # the base model and the two adapters write different texts on the same prompt
    for k in range(8):
        texts = out["rewritten"][3 * k:3 * k + 3].to_list()
        assert len(set(texts)) == 3, texts


def test_a_row_naming_an_adapter_the_job_lacks_is_that_rows_error(lora_job):
    _, summary, out = lora_job
    bad = out.filter(pl.col("lang") == "xx")
    assert bad.height == 2 and bad["error_kind"].to_list() == ["unknown_adapter"] * 2
    assert bad["error"][0] == "lang: 'xx' is not one of the job's adapters (de, fr)"
    assert summary.errors == {"unknown_adapter": 2}
    assert out.filter(pl.col("lang").ne_missing("xx"))["error"].null_count() == 24


def test_the_report_counts_rows_and_tokens_per_adapter(lora_job, root):
    _, _, out = lora_job
    report = json.loads((root / "out.report.json").read_text())
    done = out.filter(pl.col("error").is_null()).with_columns(
        pl.col("lang").fill_null("(base model)"))
    expected = {name: {"rows": g.height, "prompt_tokens": g["prompt_tokens"].sum(),
                       "completion_tokens": g["completion_tokens"].sum()}
                for (name,), g in done.group_by("lang")}
    assert report["adapters"] == dict(sorted(expected.items()))
    assert report["adapters"]["de"]["rows"] == 8
    from pipelines.report.report_text import report_lines

    assert "adapter      de: 8 rows, " in "\n".join(report_lines(report))


def test_a_job_wide_adapter_and_steps_that_each_name_one(tiny_model, adapters, root, lora_job,
                                                         ray_cluster):
    _, _, out = lora_job
    config = _config(tiny_model, adapters, root, "steps", model={"adapter": "de"})
    del config["prompt"], config["sampling"], config["output"]["column"]
    template = "Title: {{ title }}\n{{ description }}"
    config["steps"] = [
        # no adapter of its own: model.adapter (de), as the one-step job's de rows
        {"name": "draft", "prompt": {"system": "Be brief.", "template": template},
         "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS}},
        {"name": "judge", "adapter": "fr", "prompt": {"template": "Rate: {{ draft }}"},
         "sampling": {"temperature": 0.0, "max_tokens": 4}},
    ]
    run_job(load_config(config))
    steps = pl.read_parquet(root / "steps")
    de = out.filter(pl.col("lang") == "de")
    ours = steps.filter(pl.col("lang") == "de")
    assert ours["draft"].to_list() == de["rewritten"].to_list()
    assert steps["judge"].null_count() == 0
    report = json.loads((root / "steps.report.json").read_text())
    assert report["adapters"]["de"]["rows"] == steps.height  # every row's draft
    assert report["adapters"]["fr"]["rows"] == steps.height
    assert report["adapters"]["fr"]["completion_tokens"] == steps["judge_completion_tokens"].sum()


def test_a_batch_file_names_adapters_by_model(tiny_model, adapters, root, lora_job, ray_cluster):
    _, _, out = lora_job
    names = {None: "tiny-model", "de": "de", "fr": "fr"}  # the served model's name: its dir's
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": names[row["lang"]], "max_tokens": MAX_TOKENS, "temperature": 0,
                       "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": f"Title: {row['title']}\n"
                                                                f"{row['description']}"}]}}
             for i, row in enumerate(ROWS[:24])]
    lines.append({**lines[0], "custom_id": "other",
                  "body": {**lines[0]["body"], "model": "gpt-4o-mini"}})
    requests = root / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = root / "results.jsonl"
    adapters_set = [f"model.adapters.{n}={p}" for n, p in adapters.items()]
    counts = run_batch_file(requests, results, model=tiny_model, overrides=[
        f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
        "model.max_model_len=512", "resources.batch_size=8", *adapters_set])
    assert counts["results"] == 24 and counts["errors"] == 1
    got = {line["custom_id"]: line["response"]["body"]
           for line in map(json.loads, results.read_text().splitlines())}
    for i, row in enumerate(ROWS[:24]):
        body = got[f"r{i}"]
        assert body["choices"][0]["message"]["content"] == out["rewritten"][i], i
        assert body["model"] == names[row["lang"]]
    error = json.loads((root / "results.errors.jsonl").read_text())
    assert error["custom_id"] == "other" and error["error"]["code"] == "model_not_found"
    assert "'gpt-4o-mini' is neither the served model ('tiny-model') nor one of its " \
           "adapters (de, fr)" in error["error"]["message"]


def _bad_adapters(tiny_model, adapters, tmp):
    """Adapters pre-flight refuses, each in its own way."""
    import shutil

    from safetensors.torch import load_file, save_file

    made = {}
    made["missing"] = str(tmp / "nowhere")
    (tmp / "empty").mkdir()
    made["empty"] = str(tmp / "empty")
    other = tmp / "prefix"
    shutil.copytree(adapters["de"], other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config,
                                                           "peft_type": "PREFIX_TUNING"}))
    made["prefix"] = str(other)
    # another architecture: lora_A of q_proj for a hidden size of 64, where the model has 128
    wide = tmp / "other_model"
    shutil.copytree(adapters["de"], wide)
    weights = load_file(str(wide / "adapter_model.safetensors"))
    weights = {k: (v[:, :64].contiguous() if ".lora_A." in k else v) for k, v in weights.items()}
    save_file(weights, str(wide / "adapter_model.safetensors"))
    made["other_model"] = str(wide)
    lacking = tmp / "lacking"
    shutil.copytree(adapters["de"], lacking)
    (lacking / "adapter_config.json").write_text(json.dumps({**config,
                                                             "target_modules": ["c_attn"]}))
    made["lacking"] = str(lacking)
    made["rank16"] = _make_adapter(tiny_model, tmp / "rank16", 3, rank=16)
    return made


def test_preflight_names_the_adapter_that_cannot_run_in_one_line(tiny_model, adapters, root,
                                                                 tmp_path):
    bad = _bad_adapters(tiny_model, adapters, tmp_path)

    def refused(name, **model):
        config = _config(tiny_model, {"de": adapters["de"], name: bad[name]}, root, "x",
                         model=model)
        with pytest.raises(ConfigError) as caught:
            plan_job(load_config(config))
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"model.adapters.{name}: "), message
        return message

    assert refused("missing").endswith("nowhere' does not exist")
    assert "is not a PEFT adapter (no adapter_config.json)" in refused("empty")
    assert "a PREFIX_TUNING adapter, not a LoRA one" in refused("prefix")
    assert "lora_A is 8x64, the model's model.layers.0.self_attn.q_proj needs 8x128" \
        in refused("other_model")
    assert "targets c_attn, which" in refused("lacking")
    assert "rank 16 is above model.max_lora_rank 8" in refused("rank16", max_lora_rank=8)
    # declared where used, in one line too
    with pytest.raises(ConfigError, match=r"model.adapter 'es' is not one of model.adapters "
                                          r"\(de, fr\)"):
        load_config(_config(tiny_model, adapters, root, "x", model={"adapter": "es"}))
    with pytest.raises(ConfigError, match="prompt.adapter_column needs model.adapters"):
        load_config(job_config(tiny_model, root / "in.jsonl", root / "x",
                               prompt={"adapter_column": "lang"}))
    with pytest.raises(JobError, match="prompt.adapter_column 'language' is not a column"):
        plan_job(load_config(_config(tiny_model, adapters, root, "x",
                                     prompt={"adapter_column": "language"})))


def test_the_cli_says_a_missing_adapter_in_one_line(tiny_model, adapters, root, tmp_path):
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_config(tiny_model, {"de": str(tmp_path / "gone")}, root,
                                           "cli")))
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(path)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(
        "overnight: error: model.adapters.de: "), run.stderr


def test_a_server_as_the_engine_gets_each_rows_adapter_as_its_model(
        tiny_model, adapters, root, lora_job, ray_cluster, tmp_path):
    """vllm serve with the adapters loaded (--lora-modules): the job sends each row's adapter
    name as the request's model, and gets the in-process job's texts, row for row."""
    from servers import VLLMServer

    _, _, out = lora_job
    server = VLLMServer(tiny_model, tmp_path / "server.log", KV_CACHE)
    server.args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3",
                    "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    server.start()
    try:
        config = _config(tiny_model, {name: None for name in adapters}, root, "http")
        config["engine"] = {"kind": "http", "base_url": server.base_url}
        run_job(load_config(config))
    finally:
        server.kill()
    served = pl.read_parquet(root / "http")
    assert served["rewritten"].to_list() == out["rewritten"].to_list()
    assert served["error_kind"].to_list() == out["error_kind"].to_list()


def test_overnight_serve_runs_a_batch_on_the_adapter_its_model_names(
        tiny_model, adapters, lora_job, tmp_path):
    """The server's config declares the adapters; a batch whose requests name one by model
    runs on it, as the table job's rows on that adapter."""
    from servers import KEY, Server, wait

    _, _, out = lora_job
    server = Server(tmp_path, tiny_model)
    job = json.loads((tmp_path / "job.yaml").read_text())
    job["model"]["adapters"] = adapters
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    rows = [i for i, row in enumerate(ROWS) if row["lang"] == "fr"][:4]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fr", "max_tokens": MAX_TOKENS, "temperature": 0,
                       "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": f"Title: {ROWS[i]['title']}\n"
                                                                f"{ROWS[i]['description']}"}]}}
             for i in rows]
    (tmp_path / "fr.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    server.start()
    try:
        client = server.client(KEY)
        batch = client.batches.create(
            input_file_id=client.files.create(file=tmp_path / "fr.jsonl", purpose="batch").id,
            endpoint="/v1/chat/completions", completion_window="24h")
        done = wait(client, batch.id)[-1]
        assert done.status == "completed", (done.errors, server.log())
        results = {line["custom_id"]: line["response"]["body"] for line in map(
            json.loads, client.files.content(done.output_file_id).text.splitlines())}
    finally:
        server.stop()
    for i in rows:
        assert results[f"r{i}"]["choices"][0]["message"]["content"] == out["rewritten"][i]
        assert results[f"r{i}"]["model"] == "fr"
