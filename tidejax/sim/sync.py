"""The synchronous (veRL-like) system's phases, mixed into the cluster.

All GPUs run one colocated instance each: a rollout phase serves the whole batch (and, on
evaluation steps, an evaluation phase before it) to its last trajectory; then the engines
sleep, every GPU runs Ref and Actor over the batch, weights are resharded in place and the
engines wake. Nothing overlaps, so every straggler is paid by all GPUs.
"""

from __future__ import annotations


class SyncPhases:
    """Methods of :class:`tidejax.sim.cluster.Cluster` used when ``system.sync``."""

    def _begin_sync(self) -> None:
        gpus = list(range(self.cfg.n_gpus))
        for g in gpus:
            self.open_rank((g,), 0.0)
        self._sync_step_begin(0.0)

    def _step_groups(self) -> list:
        return self._sync_batch

    def _sync_step_begin(self, t: float) -> None:
        self.training_phase = False
        self.phase_start = t
        if self._eval_due():
            self.eval_barrier = True
            self._start_eval(t)
        self._fill_pending()
        batch = [g for g in self.pending if not g.is_eval][: self.batch_groups]
        self._sync_batch = batch
        self._want_tick(t)

    def _sync_train_phase(self, t: float) -> None:
        """All GPUs: engine sleeps, Ref + Actor over the batch, weights synced, engine wakes."""
        c, n = self.cost, self.cfg.n_gpus
        gpus = tuple(range(n))
        self.training_phase = True
        self.rollout_phase_s += t - self.phase_start
        tok = sum(g.train_tokens for g in self._sync_batch)
        sq = sum(g.train_sq for g in self._sync_batch)
        for r in self.ranks.values():
            r.catch_up(t)
            r.close_idle(t)
        led = self.ledger
        t1 = t + c.engine_sleep()
        led.add(gpus, t, t1, "switch")
        t2 = t1 + c.swap(n)
        led.add(gpus, t1, t2, "swap")
        t3 = t2 + c.ref(tok, sq, n)
        led.add(gpus, t2, t3, "ref")
        t4 = t3 + c.train(tok, sq, n)
        led.add(gpus, t3, t4, "actor")
        t5 = t4 + c.colocated_sync()
        led.add(gpus, t4, t5, "sync")
        t6 = t5 + c.engine_wake()
        led.add(gpus, t5, t6, "switch")
        for g in self._sync_batch:
            self._consume(g)
        self.version += 1
        self.rollout_version = self.version
        self.steps_done += 1
        self.step_marks.append(t6)
        self.consumed_marks.append(self.consumed_resp)
        for r in self.ranks.values():
            r.pool.flush()
            r.t0 = t6
            r.idle_since = t6
        if self.steps_done >= self.cfg.steps:
            self.finished, self.end_t = True, t6
            return
        self.push(t6, self._sync_step_begin, t6)
