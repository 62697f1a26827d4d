"""ddiloco inside your own training loop: ``ddiloco.Learner``.

The user keeps the loop, the loss, the data and the inner optimizer; the learner engine
(:mod:`.engine`, the same one ddiloco's built-in loop runs) does the rest after every inner
step — the report, the answers, the merged fragments, a peer's snapshot, the saves::

    learner = ddiloco.Learner(model, optimizer)   # reads what the launcher put in the env
    start = learner.start()                       # welcome, or a copy: start.step
    for batch in my_loader(skip=start.step):
        loss = my_loss(model, batch); loss.backward(); optimizer.step(); optimizer.zero_grad()
        if not learner.step(tokens=len_in_tokens(batch), loss=loss.item()):
            break
    learner.close()

Where it connects comes from the keyword arguments, else the environment the launcher (or
``ddiloco learner --entry``) sets: :data:`ENV` names every variable. The run's config
(``DDILOCO_CONFIG``) names the model (``model = "module:function"``): the syncer builds it
for the initial global values and the fragment plan, so the model handed to the Learner
must have the same parameters (names and shapes; checked) and starts from those values.

Call order, checked (:class:`Phase`): ``start`` once, then ``step`` after each optimizer
step until it returns False, then ``close`` (the context-manager form closes for you).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ddiloco.config import RunConfig, load_config
from ddiloco.core.shards import shard_rows
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.imports import find_callable
from ddiloco.report.progress import terminal_sink
from ddiloco.runtime.processes.learner.options import LearnerOptions
from ddiloco.runtime.processes.learner.ranks import RankGroup
from ddiloco.runtime.processes.learner.sharded_engine import engine_for
from ddiloco.runtime.processes.terminate import on_terminate
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.sockets import load_secret
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)

# keyword argument -> the environment variable that gives it when the keyword is not given
ENV = {
    "syncer": "DDILOCO_SYNCER",  # HOST:PORT
    "learner": "DDILOCO_LEARNER",  # the slot: which learner this is
    "config": "DDILOCO_CONFIG",  # the run's TOML config file
    "set": "DDILOCO_SET",  # a JSON list of key=value overrides of it (as --set takes them)
    "secret_file": "DDILOCO_SECRET_FILE",  # else $DDILOCO_SECRET (hex)
    "run_id": "DDILOCO_RUN_ID",  # default: the config's name
    "method": "DDILOCO_METHOD",
    "join": "DDILOCO_JOIN",  # 1: copy a healthy peer first (a restart)
    "resume": "DDILOCO_RESUME",  # 1: start from this learner's newest local save
    "state_dir": "DDILOCO_STATE_DIR",
    "peer_host": "DDILOCO_PEER_HOST",
    "peer_port": "DDILOCO_PEER_PORT",
    "peer_bind": "DDILOCO_PEER_BIND",
    "leave_after": "DDILOCO_LEAVE_AFTER",
    "max_steps": "DDILOCO_MAX_STEPS",
    "t0": "DDILOCO_T0",  # the run's start (epoch s): event times count from it
}


class Phase(Enum):
    """Where a :class:`Learner` is in its call order."""

    NEW = "new"  # made; start() not called
    TRAINING = "training"  # started: step() after each optimizer step
    STOPPED = "stopped"  # step() returned False (or the run ended before we were let in)
    CLOSED = "closed"  # close() was called


@dataclass(frozen=True)
class Start:
    """Where training starts: ``step`` (the inner step to continue from: skip that many
    batches), ``source`` (``fresh``, ``peer``, ``syncer``, ``local``: a state copied from a
    healthy peer, the syncer's global fragments with a fresh optimizer, this learner's own
    save), and ``tokens`` the state held had trained (0 unless copied or resumed)."""

    step: int
    source: str
    tokens: int = 0


class OwnReplica:
    """A user's model and optimizer as the engine's :class:`~.engine.Replica`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.steps = 0
        self.tokens = 0  # this rank's tokens, copied with the state

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def state(self, copy: bool = True) -> dict[str, Any]:
        model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "model": deepcopy(model) if copy else model,
            "optimizer": deepcopy(optimizer) if copy else optimizer,
            "steps": self.steps,
            "position": self.steps,  # the user's loader skips ``steps`` batches
            "tokens": self.tokens,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.tokens = int(state.get("tokens", 0))

    def state_bytes(self) -> int:
        """Bytes a peer copy moves: the parameters and the optimizer's state (at least two
        moments' worth: AdamW's, before its first step has made them)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        held = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        return params + max(held, 2 * params)


class Learner:
    """One learner of a Decoupled DiLoCo run, around the caller's model and optimizer.

    ``model``: any ``nn.Module`` (a DDP wrapper is looked through); ``optimizer``: its inner
    optimizer, whose ``state_dict`` a newcomer copies. Keyword arguments override the
    environment (:data:`ENV`); ``config`` may be a path or a :class:`RunConfig`, ``secret``
    the run secret's bytes.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        secret: bytes | None = None,
        config: str | Path | RunConfig | None = None,
        **given: Any,
    ) -> None:
        self.phase = Phase.NEW
        _made.append(self)  # (run_entry checks its entry point made one)
        self.unwelcomed = False  # the run ended before a syncer let us in
        unknown = sorted(set(given) - set(ENV))
        if unknown:
            raise ConfigError("ddiloco.Learner", unknown[0], f"unknown argument; use {list(ENV)}")
        where = _where(given)
        self.config = config if isinstance(config, RunConfig) else _config(config, where)
        module = _unwrapped(model)
        method = str(where.get("method") or "decoupled")
        self.setup = RunSetup(self.config, method)
        _same_parameters(module, self.setup.model, self.config.model)
        _copyable(optimizer)
        with torch.no_grad():  # the run's initial values (the syncer's Theta_0)
            initial = dict(self.setup.model.named_parameters())
            for name, p in module.named_parameters():
                if isinstance(p, DTensor):  # FSDP2: this rank's rows of it
                    lo, hi = shard_rows(p.shape[0], *_rank_of(p))
                    p.to_local().copy_(initial[name][lo:hi])
                else:
                    p.copy_(initial[name])
        self.setup.model = module  # Theta_0 is the user's model now: no second copy
        self.id = _int(where, "learner", None)
        if self.id is None or not 0 <= self.id < self.setup.slots:
            raise ConfigError(
                ENV["learner"], self.id, f"which learner this is: 0..{self.setup.slots - 1}"
            )
        syncer = where.get("syncer")
        if not syncer:
            raise ConfigError(ENV["syncer"], syncer, "the syncer's HOST:PORT: set it or pass it")
        secret = secret if secret is not None else load_secret(where.get("secret_file"))
        self.leaving = threading.Event()
        device = next(module.parameters()).device
        self.ranks = RankGroup(device.type, terminated=self.leaving)
        self.replica = OwnReplica(module, optimizer)
        t0 = float(where.get("t0") or time.time())
        every = self.config.report.progress_seconds
        state_dir = where.get("state_dir")
        self.engine = engine_for(
            self.setup,
            self.id,
            str(syncer),
            str(where.get("run_id") or self.config.name),
            secret,
            Events(t0, sink=terminal_sink(self.config.train.tokens, every, method)),
            self.replica,
            self.ranks,
            self.leaving,
            LearnerOptions(
                join=_flag(where, "join"),
                resume=_flag(where, "resume"),
                leave_after=float(where.get("leave_after") or 0.0),
                peer_host=str(where.get("peer_host") or "127.0.0.1"),
                peer_port=_int(where, "peer_port", 0) or 0,
                peer_bind=where.get("peer_bind") or None,
                max_steps=_int(where, "max_steps", 0) or 0,
                state_dir=Path(state_dir) if state_dir else None,
            ),
        )

    # -- the call order ----------------------------------------------------------------------
    def start(self) -> Start:
        """Recover (a peer's copy, this learner's save, else the syncer's fragments) or start
        fresh, and wait for the syncer's welcome. A run that ended before a syncer let us in
        gives ``Start(step, "ended")``: every ``step`` then returns False."""
        self._require(Phase.NEW, "start")
        engine = self.engine
        on_terminate(self.leaving.set)  # SIGTERM: a clean leave at the next step
        if not engine.start():  # (the engine closed itself)
            self.phase, self.unwelcomed = Phase.STOPPED, True
            return Start(engine.sync.step, "ended")
        self.phase = Phase.TRAINING
        self.replica.steps = engine.sync.step
        copied = self.replica.tokens > 0 or engine.sync.step > 0
        source = "fresh"
        if copied:
            source = "local" if engine.resume else ("peer" if engine.bytes_peer else "syncer")
        return Start(engine.sync.step, source, self.replica.tokens * self.ranks.world)

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """After one optimizer step on ``tokens`` (this rank's): report it, answer what the
        syncer asked, apply the merged fragments that arrived. False: stop training (the run
        is over, this learner was asked to leave, or its limits were reached)."""
        if self.phase is Phase.STOPPED:
            return False
        self._require(Phase.TRAINING, "step")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ConfigError("tokens", tokens, "the tokens this rank trained this step: an int")
        self.replica.steps += 1
        self.replica.tokens += tokens
        if not self.engine.step(tokens, loss):
            self.phase = Phase.STOPPED
            return False
        return True

    def close(self, why: str | None = None) -> None:
        """Say goodbye (when leaving before the syncer said stop: ``why``, else the reason
        this learner stopped), save, and close the connections. Idempotent."""
        if self.phase is Phase.CLOSED:
            return
        started, self.phase = self.phase is not Phase.NEW, Phase.CLOSED
        if not started:  # never connected: nothing to say or save
            self.ranks.close()
            return
        if self.unwelcomed:  # (the engine closed itself)
            return
        try:
            self.engine.finish(why)
        finally:
            self.engine.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if kind is None:
            self.close()
        elif self.phase is not Phase.CLOSED:  # the loop failed: no goodbye, no save
            self.phase = Phase.CLOSED
            if not self.unwelcomed:
                self.engine.close()

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def _require(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            said = {
                Phase.NEW: "called before start()",
                Phase.TRAINING: "called twice",
                Phase.STOPPED: "called after training stopped",
                Phase.CLOSED: "called after close()",
            }[self.phase]
            raise DDiLoCoError(f"Learner.{call}", self.phase.value, said)


def _rank_of(p: DTensor) -> tuple[int, int]:
    """(world, rank) of a parameter FSDP2 sharded on dim 0 over a 1-D mesh; others refused."""
    mesh = p.device_mesh
    placements = p.placements
    if mesh.ndim != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise ConfigError(
            "model",
            f"{p.placements} over a {mesh.ndim}-D mesh",
            "a sharded learner takes parameters sharded on dim 0 over one mesh dimension "
            "(fully_shard's default)",
        )
    return mesh.size(), mesh.get_local_rank()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP (or similar) wrapper: its parameters' names are the run's."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module  # type: ignore[no-any-return]
    return model


def _where(given: dict[str, Any]) -> dict[str, Any]:
    """Each setting: its keyword argument, else its environment variable, else absent."""
    out: dict[str, Any] = {}
    for key, var in ENV.items():
        value = given.get(key)
        if value is None:
            value = os.environ.get(var) or None
        if value is not None:
            out[key] = value
    return out


def _config(path: str | Path | None, where: dict[str, Any]) -> RunConfig:
    """The run's config: ``config=``, else $DDILOCO_CONFIG with $DDILOCO_SET's overrides
    (both may be absent under ``ddiloco learner``: the embedded default with overrides)."""
    overrides = where.get("set") or "[]"
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError:
            overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(ENV["set"], where.get("set"), "a JSON list of key=value strings")
    path = path or where.get("config")
    if not path and not overrides:
        raise ConfigError(ENV["config"], None, "the run's config file: set it or pass config=")
    return load_config(path or None, overrides)


def _int(where: dict[str, Any], key: str, default: int | None) -> int | None:
    value = where.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(ENV[key], value, "must be an integer") from None


def _flag(where: dict[str, Any], key: str) -> bool:
    return str(where.get(key, "")).lower() in ("1", "true", "yes")


def _same_parameters(model: nn.Module, reference: nn.Module, name: str) -> None:
    """The run's model (what the syncer builds) and the caller's have the same parameters."""
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    run = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    for n in sorted(set(mine) | set(run)):
        if mine.get(n) != run.get(n):
            raise ConfigError(
                "model",
                name,
                f"the model given to ddiloco.Learner has parameter {n!r} of shape "
                f"{mine.get(n)} where the run's model has {run.get(n)}: the syncer builds "
                "the config's model, so both must be the same architecture",
            )


def _copyable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose state a newcomer could not copy (only tensors, numbers,
    strings and containers of them cross the wire: nothing is pickled)."""
    bad = _uncopyable(optimizer.state_dict(), "optimizer")
    if bad is not None:
        path, value = bad
        raise ConfigError(
            path,
            type(value).__name__,
            "the optimizer's state holds a value a peer cannot copy (tensors, numbers, "
            "strings, lists and dicts only)",
        )


def _uncopyable(node: Any, path: str) -> tuple[str, Any] | None:
    if isinstance(node, torch.Tensor | int | float | str | bool | bytes) or node is None:
        return None
    if isinstance(node, dict):
        items = [(f"{path}.{k}", v) for k, v in node.items()]
    elif isinstance(node, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
    else:
        return path, node
    for where, value in items:
        bad = _uncopyable(value, where)
        if bad is not None:
            return bad
    return None


# -- train.entry: a user's function as a learner process ---------------------------------------
_made: list[Learner] = []  # the Learners made in this process (an entry point's)


def resolve_entry(spec: str, field: str = "train.entry") -> Callable[[], Any]:
    """The function ``module:function`` names, or a :class:`ConfigError` saying why not."""
    return find_callable(spec, field)


def run_entry(spec: str, env: dict[str, Any]) -> int:
    """Run the user's ``module:function`` as this learner: ``env`` (keyword -> value, see
    :data:`ENV`) goes into the environment its ``ddiloco.Learner`` reads. It must make and
    start one (else it is refused: a learner that never connects would look like a crash);
    one it left open is closed here. Its exceptions propagate: the process fails and the
    launcher restarts it, as a crashed built-in learner."""
    function = resolve_entry(spec)
    for key, value in env.items():
        os.environ[ENV[key]] = str(value)
    _made.clear()
    result = function()
    started = [learner for learner in _made if learner.phase is not Phase.NEW]
    for learner in _made:
        if not learner.closed:
            log.warning("%s returned without closing its ddiloco.Learner: closed now", spec)
            learner.close()
    if not started:
        raise ConfigError(
            "train.entry",
            spec,
            "returned without starting a ddiloco.Learner (make one around your model and "
            "optimizer, call start(), then step() after every optimizer step)",
        )
    return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0
