"""The training loop: plain PyTorch, objective-agnostic, resumable bit for bit.

``train(config, out_dir, resume=False)`` writes into ``out_dir``: the resolved
``config.yaml``, ``metrics.jsonl``, ``status.json``, ``checkpoints/`` and
``tensorboard/``. It returns the final status; a diverged run raises
:class:`~kilolayer.errors.DivergedError` (exit code 3 from the CLI) after
recording ``status: diverged`` with its step and reason.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from kilolayer.config import Config, dump_yaml, load_config
from kilolayer.data import load_source
from kilolayer.errors import ConfigError, DivergedError, InputError
from kilolayer.objectives import build_task
from kilolayer.train import checkpoint as ckpt
from kilolayer.train import diagnostics as diag
from kilolayer.train import distributed as D
from kilolayer.train.logging import MetricsLog, Progress, truncate_metrics, write_status
from kilolayer.train.optim import build_optimizer, build_scheduler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for state.json)."""
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack([s for s in torch.cuda.get_rng_state_all()])
    np_state = np.random.get_state()
    plain = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, plain


def set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))
    v, s, g = plain["python"]
    random.setstate((v, tuple(s), g))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def split_batch(batch: dict, parts: int) -> list[dict]:
    if parts == 1:
        return [batch]
    chunks = {k: v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def _autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _full_params(module, env: D.Dist, mode: str):
    """Under FSDP2, gather the root's parameters (embeddings, heads) for calls that bypass task.forward."""
    if env.active and mode == "fsdp":
        module.unshard()
        try:
            yield
        finally:
            module.reshard()
    else:
        yield


class Trainer:
    def __init__(self, config: Config, out_dir: Path, resume: bool = False, quiet: bool = False):
        self.config, self.out, self.resume, self.quiet = config, Path(out_dir), resume, quiet
        tc = config.train
        self.env = D.setup(tc.device)
        if tc.batch_size % (self.env.world * tc.accumulate):
            raise ConfigError(
                f"train.batch_size={tc.batch_size}: must be divisible by processes x train.accumulate "
                f"({self.env.world} x {tc.accumulate})"
            )
        self.source = load_source(config)
        seed_everything(tc.seed)
        self.task = build_task(config)
        obj = self.task.objective
        if hasattr(obj, "attach_data"):
            obj.attach_data(self.source)
        self.start_step = 0
        # ema: the smoothed training loss (bias-corrected, weight 0.9); running_min: its minimum
        self.state = {"running_min": math.inf, "ema": 0.0, "ema_weight": 0.0, "tokens": 0}
        latest = ckpt.latest_checkpoint(self.out) if resume else None
        if latest is None:
            self._fresh_start()
        self.task.to(self.env.device)
        if tc.compile:
            for _, layer in diag.layer_names(self.task.backbone):
                layer.compile()
        self.model = D.wrap(self.task, tc.parallel, self.env)
        params = [p for p in self.task.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("train: nothing to train (every parameter is frozen)")
        self.optimizer = build_optimizer(self.task, tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.reference = None  # F(x, theta_0) on the probe batch
        self.probe_batch = None
        if tc.diagnostics_every:
            self.probe_batch = to_device(next(self.source.eval_batches(min(8, tc.batch_size), 8)), self.env.device)
        if latest is not None:
            self._restore(latest)
        elif self.probe_batch is not None:
            with _full_params(self.model, self.env, tc.parallel):
                self.reference = diag.probe(obj, self.task.backbone, self.probe_batch)[0]

    # -------------------------------------------------------------- set-up

    def _fresh_start(self) -> None:
        tc = self.config.train
        if self.env.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(dump_yaml(self.config))
            for stale in ("metrics.jsonl", "status.json"):
                (self.out / stale).unlink(missing_ok=True)
        D.barrier(self.env)
        if tc.init_from:
            from kilolayer.train.init_from import load_pretrained

            load_pretrained(self.task, tc.init_from, freeze=tc.freeze_backbone)
        if self.config.model.scheme == "admin" and self.config.model.admin_omega == "profile":
            from kilolayer.nn.residual import admin_profile

            batch = self.source.train_batch(0, self.config.train.batch_size)
            admin_profile(self.task.backbone, lambda: self.task.objective(self.task.backbone, batch))

    def _restore(self, path: Path) -> None:
        tc = self.config.train
        data = ckpt.load_checkpoint(path)
        ckpt.check_fits(path / "model.safetensors", data["model"], self.task.state_dict())
        D.load_model_state(self.model, data["model"])
        if tc.freeze_backbone:
            for p in self.task.backbone.parameters():
                p.requires_grad_(False)
        try:
            D.load_optimizer_state(self.model, self.optimizer, data["optimizer"]["optimizer"])
            self.scheduler.load_state_dict(data["optimizer"]["scheduler"])
        except (KeyError, ValueError, RuntimeError) as err:
            raise InputError(f"{path / 'optimizer.pt'}: does not fit this run ({str(err).splitlines()[0][:100]})") from None
        st = data["state"]
        self.start_step = int(st["step"])
        self.state.update(st["trainer"])
        set_rng_state(data["rng"], st["rng"])
        if "reference" in data["extra"]:
            self.reference = data["extra"]["reference"].to(self.env.device)
        if self.env.main:
            truncate_metrics(self.out, self.start_step)
            ckpt.remove_partial(self.out)

    # -------------------------------------------------------------- pieces

    def save(self, step: int) -> None:
        model_sd = D.model_state(self.model)
        optim_sd = D.optimizer_state(self.model, self.optimizer)
        if self.env.main:
            tensors, plain = rng_state()
            extra = {"reference": self.reference.cpu()} if self.reference is not None else None
            ckpt.save_checkpoint(
                self.out, step, model_sd, {"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()},
                tensors, {"step": step, "rng": plain, "trainer": self.state}, extra, keep=self.config.train.keep_checkpoints,
            )
        D.barrier(self.env)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        tc = self.config.train
        self.task.eval()
        # evaluation must not consume the training RNG streams (bit-exact resume)
        with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
            with _full_params(self.model, self.env, tc.parallel), _autocast(tc.precision, self.env.device):
                batches = (to_device(b, self.env.device) for b in self.source.eval_batches(tc.batch_size,
                                                                                           tc.eval_batches * tc.batch_size))
                metrics = self.task.objective.evaluate(self.task.backbone, batches)
                save = getattr(self.task.objective, "save_samples", None)
                if save is not None and self.env.main:
                    # e.g. MAE's original / masked / reconstruction grid
                    batch = to_device(next(self.source.eval_batches(8, 8)), self.env.device)
                    save(self.task.backbone, batch, self.out / "samples" / f"step_{step:08d}.png")
        self.task.train()
        return {k: float(v) for k, v in metrics.items()}

    def diagnostics(self, step: int, names: list[str], norms: list[float]) -> dict:
        with torch.random.fork_rng(devices=[]), _full_params(self.model, self.env, self.config.train.parallel):
            out, ln_names, ln_values = diag.probe(self.task.objective, self.task.backbone, self.probe_batch)
        return {"step": step, "split": "diagnostics", "layers": names, "grad_norm": norms,
                "update": diag.update_size(out, self.reference), "ln_names": ln_names, "ln_input": ln_values}

    def _smoothed(self, loss: float) -> float:
        st = self.state
        st["ema"] = 0.9 * st["ema"] + 0.1 * loss
        st["ema_weight"] = 0.9 * st["ema_weight"] + 0.1
        return st["ema"] / st["ema_weight"]

    def _diverged(self, step: int, loss: float) -> str:
        """Non-finite loss, or (after warm-up) a smoothed loss above factor x its running minimum and above
        that minimum by ``diverge_increase``. Updates the smoothed loss and its minimum."""
        tc = self.config.train
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        smooth = self._smoothed(loss)
        best = self.state["running_min"]
        if step > tc.warmup and smooth > tc.diverge_factor * best and smooth > best + tc.diverge_increase:
            return (f"smoothed loss {smooth:.4g} at step {step} exceeds {tc.diverge_factor:g} x its running minimum "
                    f"{best:.4g}")
        self.state["running_min"] = min(best, smooth)
        return ""

    # -------------------------------------------------------------- the loop

    def run(self) -> dict:
        tc, env = self.config.train, self.env
        log = MetricsLog(self.out, tensorboard=env.main) if env.main else None
        progress = Progress(tc.steps, self.start_step, enabled=env.main and not self.quiet)
        model = self.model
        model.train()
        diag_on = tc.diagnostics_every > 0
        reduce = (lambda t: _all_sum(t, env)) if env.active else None
        last_good = self.start_step
        t_last, tokens_last = time.perf_counter(), self.state["tokens"]
        try:
            for step in range(self.start_step + 1, tc.steps + 1):
                batch = self.source.train_batch(step - 1, tc.batch_size, env.rank, env.world)
                loss_sum, tokens = 0.0, 0
                micro = split_batch(batch, tc.accumulate)
                for i, mb in enumerate(micro):
                    mb = to_device(mb, env.device)
                    sync = contextlib.nullcontext()
                    if env.active and tc.parallel == "ddp" and i < len(micro) - 1:
                        sync = model.no_sync()
                    with sync:
                        with _autocast(tc.precision, env.device):
                            loss, _ = model(mb)
                        (loss / len(micro)).backward()
                    loss_sum += float(loss.detach()) / len(micro)
                    tokens += self.task.objective.tokens(mb)
                loss_value = D.all_mean(loss_sum, env)
                do_diag = diag_on and (step == 1 or step % tc.diagnostics_every == 0) and (
                    not tc.diagnostics_until or step <= tc.diagnostics_until)
                layer_norms = diag.grad_norms(self.task.backbone, reduce) if do_diag else None
                gnorm = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.task.parameters() if p.grad is not None],
                    tc.clip if tc.clip > 0 else float("inf"),
                )
                reason = self._diverged(step, loss_value)
                if reason:
                    self.optimizer.zero_grad(set_to_none=True)
                    if log:
                        log.write({"step": step, "split": "train", "loss": loss_value})
                        write_status(self.out, "diverged", step, reason, last_checkpoint=last_good)
                    raise DivergedError(reason)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.state["tokens"] += tokens * env.world
                if log and (step % tc.log_every == 0 or step == tc.steps):
                    now = time.perf_counter()
                    rate = (self.state["tokens"] - tokens_last) / max(now - t_last, 1e-9)
                    t_last, tokens_last = now, self.state["tokens"]
                    log.write({"step": step, "split": "train", "loss": loss_value,
                               "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(gnorm),
                               "tokens": self.state["tokens"], "tokens_per_s": rate})
                    progress.update(step, f"loss {loss_value:.4f} lr {self.scheduler.get_last_lr()[0]:.2e} "
                                          f"{rate:,.0f} tok/s")
                if do_diag:
                    rec = self.diagnostics(step, *layer_norms)
                    if log:
                        log.write(rec)
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    metrics = self.evaluate(step)
                    if log:
                        log.write({"step": step, "split": "eval", **metrics})
                if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps:
                    self.save(step)
                    last_good = step
            if tc.steps == 0 and self.start_step == 0:
                self.save(0)  # an untrained run is still a run: analysis can load it
            if env.main:
                write_status(self.out, "completed", tc.steps, "", tokens=self.state["tokens"])
            return {"status": "completed", "step": tc.steps}
        finally:
            progress.close()
            if log:
                log.close()


def _all_sum(t: torch.Tensor, env: D.Dist) -> torch.Tensor:
    import torch.distributed as dist

    t = t.to(env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.cpu()


def resolve_config(config, out_dir: Path, resume: bool, sets: "list[str] | None" = None) -> Config:
    """The config a run uses. Resuming a run that has a config.yaml: that file, plus ``sets``; a config
    given as well must agree with it on model, objective and data (the train section may change,
    e.g. more steps)."""
    saved = Path(out_dir) / "config.yaml"
    if resume and saved.is_file():
        original = load_config(saved)

        def same_run(cfg: Config) -> None:
            for section in ("model", "objective", "data"):
                a, b = getattr(cfg, section).model_dump(), getattr(original, section).model_dump()
                for key in a:
                    if a[key] != b.get(key):
                        raise ConfigError(
                            f"{section}.{key}={a[key]!r}: differs from the run being resumed "
                            f"({saved} has {b.get(key)!r}); only train.* may change on --resume"
                        )

        resumed = load_config(saved, sets)
        if config is not None:
            given = load_config(config, sets)
            same_run(given)
            resumed = load_config({**resumed.model_dump(), "train": given.train.model_dump()})
        same_run(resumed)
        return resumed
    if config is None:
        raise ConfigError(f"{out_dir}: nothing to resume (no config.yaml); give a CONFIG to start a run")
    if isinstance(config, Config):
        return load_config(config.model_dump(), sets) if sets else config
    return load_config(config, sets)


def train(config: "Config | dict | str | Path | None", out_dir: "str | Path", resume: bool = False,
          sets: "list[str] | None" = None, quiet: bool = False) -> dict:
    """Train a config into ``out_dir`` (see module docstring).

    ``resume=True`` continues from the newest complete checkpoint (or starts, if there is none).
    Without it, a directory that already holds a run is refused, so nothing is overwritten.
    """
    out = Path(out_dir)
    if not resume and ((out / "status.json").exists() or ckpt.latest_checkpoint(out) is not None):
        raise ConfigError(f"{out}: already holds a run; add --resume to continue it, or choose another --out")
    trainer = Trainer(resolve_config(config, out, resume, sets), out, resume=resume, quiet=quiet)
    try:
        return trainer.run()
    finally:
        D.teardown()
