"""Metrics sinks (rank 0): JSONL (the source of truth for plots and resume checks), TensorBoard,
optionally Weights & Biases, a progress bar. JSONL rows are flushed per step so a killed run keeps
everything it logged. A resumed run continues the same W&B run (its id is kept in the run dir)."""
from __future__ import annotations

import json
import math
import os


class MetricsLogger:
    def __init__(self, out_dir: str, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 initial_step: int = 0, name: str = "metrics.jsonl", desc: str = "s3ac",
                 wandb_project: str | None = None, run_config: dict | None = None):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, name)
        self._f = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tb = None
        self.wandb = None
        if wandb_project:
            import wandb  # validated at config time (train.wandb_project)

            id_path = os.path.join(out_dir, "wandb_run_id")
            run_id = open(id_path).read().strip() if os.path.exists(id_path) else wandb.util.generate_id()
            with open(id_path, "w") as f:
                f.write(run_id)
            self.wandb = wandb.init(project=wandb_project, id=run_id, resume="allow", dir=out_dir,
                                    name=os.path.basename(os.path.abspath(out_dir)), config=run_config)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)

    def log(self, m: dict) -> None:
        row = {k: (v if isinstance(v, (int, str)) else float(v)) for k, v in m.items()}
        self._f.write(json.dumps(row, allow_nan=True) + "\n")
        self._f.flush()
        step = int(m.get("step", 0))
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self.bar is not None:
            self.bar.update(1)
            post = {k.split("/")[-1]: f"{row[k]:.3g}" for k in ("rollout/pass_rate", "critic/explained_variance",
                                                                 "actor/grad_norm") if k in row}
            self.bar.set_postfix(post)

    def close(self):
        self._f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()


def truncate_after(path: str, step: int) -> None:
    """On resume: drop rows logged after the checkpointed step (they will be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [l for l in f if l.strip() and json.loads(l).get("step", -1) < step]
    with open(path, "w") as f:
        f.writelines(rows)
