"""The ladder: its steps in order (:data:`LADDER`), a batch of loads on its way down them (:class:`Ladder`).

A mode is the kinds of step it allows (:data:`~plancache.client.context.MODE_STEPS`, by
:class:`~plancache.client.context.Builds`). A new step is one :class:`~plancache.client.steps.Step` subclass and one
entry in :data:`LADDER` (or in ``ClientConfig.steps``); a step sees only its cache's
:class:`~plancache.client.context.LoadContext`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import PlanMiss
from .context import MODE_STEPS, Builds, LoadContext, Mode, Pending, bump
from .plan import Plan
from .steps import DiskStep, HeuristicStep, MemoryStep, RebuildStep, Step

StepFactory = Callable[[LoadContext], Step]


def index_step(context: LoadContext) -> Step:
    """The static index's step (:class:`plancache.client.index.IndexStep`), imported when a cache is made."""
    from .index import IndexStep

    return IndexStep(context)


def server_step(context: LoadContext) -> Step:
    """The server's step (:class:`plancache.client.server_step.ServerStep`), imported when a cache is made: the HTTP
    client and the wire protocol's models stay out of the client's import."""
    from .server_step import ServerStep

    return ServerStep(context)


#: The ladder, in order; a mode keeps the steps it allows.
LADDER: tuple[StepFactory, ...] = (MemoryStep, DiskStep, index_step, server_step, RebuildStep, HeuristicStep)


class Ladder:
    """The steps of one cache: ``factories`` made with ``context``, those ``mode`` allows, in order. Loads run one at a
    time: :meth:`load` holds the context's lock."""

    def __init__(self, context: LoadContext, factories: tuple[StepFactory, ...], mode: Mode) -> None:
        self.context = context
        self.mode = mode
        allowed = MODE_STEPS[mode]
        self.steps: list[Step] = [step for step in (make(context) for make in factories) if step.builds in allowed]

    def load(self, batch: list[Pending], builds: frozenset[Builds] | None = None) -> list[Plan | PlanMiss]:
        """Each step in turn (those that build what ``builds`` allows, default all) for the loads still pending;
        results in the order of ``batch``."""
        t0, c = time.perf_counter(), self.context
        with c.lock:
            try:
                plans: dict[Pending, Plan] = {}
                left = batch
                for step in self.steps:
                    if builds is not None and step.builds not in builds:
                        continue
                    if not left:
                        break
                    name, found = str(step.name), step.resolve(left)
                    for p, plan in found.items():
                        if p.graph is None and not p.warm:  # a plan in a caller's own graph is that caller's alone
                            c.memory[p.key] = plan
                        bump(c.stats.hits, name)
                    plans.update(found)
                    left = [p for p in left if p not in found]
                    if step.builds is not Builds.NOTHING:  # a miss: built, not served
                        c.stats.misses += len(found)
                    if left and step.counts_fallbacks:
                        bump(c.stats.fallbacks, name, len(left))
                c.stats.misses += len(left)
                return [plans[p] if p in plans else self._miss(p) for p in batch]
            finally:
                for step in self.steps:
                    step.finish()
                c.stats.load_seconds += time.perf_counter() - t0

    def _miss(self, p: Pending) -> PlanMiss:
        c = self.context
        hint = "" if c.signatures_checked else (
            f" — {self.mode} mode admits signed plans only and no trusted keys are configured "
            "(PLANCACHE_TRUSTED_KEYS or trusted_keys=)")
        return PlanMiss(f"no verified tuned plan for {p.spec.name or 'graph'} ({p.key}) on "
                        f"{c.environment.describe()} ({self.mode} mode): {'; '.join(p.trail)}{hint}")
