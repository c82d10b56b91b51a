"""MetaSchedule auto-tuning of the TVM-generated CPU kernels (RATEX_TUNE).

A `Tuner` owns one MetaSchedule JSON database (a directory inside the compile
cache). Its pass runs in the CPU pipeline after FuseTIR, before ratex's default
schedules: every kernel (PrimFunc) gets the best schedule the database holds
for it; with `trials` > 0, kernels the database has never seen are tuned first
(`trials` measured candidates each). Kernels without a usable record keep the
default schedules (schedules.py).

Every tuned kernel also gets a record of ratex's default schedule, measured
the same way, so a short random search never replaces it by a slower one.

Kernels are named by MetaSchedule's workload hash. A compile reports, per
kernel, a fingerprint of the records it used (`None`: none), so the disk cache
can tell a program compiled before its kernels were tuned (or retuned) from a
current one (`Tuner.is_current`).

Candidates are built in this process and timed one at a time in one worker
process (tuning_worker.py), so a candidate that crashes cannot take the
training process with it. TVM's own LocalBuilder/LocalRunner are not used:
they need cloudpickle (not installed) and a process pool per kind, too many
processes for a 2-core machine.
"""
import contextlib
import importlib
import importlib.util
import itertools
import json
import logging
import os
import platform
import select
import subprocess
import sys
import tempfile
import warnings

import tvm
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.ir.utils import derived_object

from .schedules import default_schedule

_FAILED = 1e10  # MetaSchedule's run time of a candidate that failed to build or run
# Enough repeats to rank candidates on a busy machine; each measurement stays short.
_NUMBER, _MIN_REPEAT_MS = 3, 20
_RUN_TIMEOUT_S = 60
_START_TIMEOUT_S = 300


@derived_object
class _Builder(ms.builder.PyBuilder):
    """Builds candidates in this process into libraries under `tmp_dir`."""

    def __init__(self, tmp_dir):
        super().__init__()
        self.tmp_dir = tmp_dir
        self._ids = itertools.count()

    def build(self, build_inputs):
        results = []
        for inp in build_inputs:
            path = os.path.join(self.tmp_dir, f"candidate-{next(self._ids)}.so")
            try:
                _build_candidate(inp.mod, inp.target).export_library(path)
                results.append(ms.builder.BuilderResult(path, None))
            except Exception as err:  # noqa: BLE001 - a candidate that does not build is a failed trial
                results.append(ms.builder.BuilderResult(None, f"build failed: {err}"))
        return results


def _build_candidate(mod, target):
    # MetaSchedule's default_build, less its import of tvm.s_tir.tensor_intrin
    # (see _register_cpu_intrinsics).
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target)


@derived_object
class _Runner(ms.runner.PyRunner):
    """Times candidates in a worker process (tuning_worker.py), one at a time.

    TVM's LocalRunner needs cloudpickle (not installed) and a process pool; one
    worker suits a 2-core machine, where a second measuring process would only
    disturb the first. A candidate that crashes or hangs takes the worker down
    and is recorded as failed; the next one gets a new worker.
    """

    def __init__(self):
        super().__init__()
        self.command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning_worker.py")]
        self.proc = None

    def run(self, runner_inputs):
        futures = []
        for inp in runner_inputs:
            request = {
                "lib": str(inp.artifact_path), "args": [list(a.as_json()) for a in inp.args_info],
                "number": _NUMBER, "min_repeat_ms": _MIN_REPEAT_MS,
            }
            answer = self._ask(request)
            with contextlib.suppress(OSError):
                os.remove(request["lib"])  # measured once; the database keeps the trace, not the code
            futures.append(ms.runner.local_runner.LocalRunnerFuture(
                res=answer.get("costs"), error_message=None if "costs" in answer else answer["error"],
            ))
        return futures

    def _ask(self, request):
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            # Importing TVM takes a while on a busy machine; that is not the candidate's time.
            if self._read(_START_TIMEOUT_S) is None:
                self.close()
                return {"error": "the measuring process did not start"}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        answer = self._read(_RUN_TIMEOUT_S)
        if answer is None:
            self.close()
            return {"error": "the candidate crashed or hung the measuring process"}
        return answer

    def _read(self, timeout):
        """The worker's next JSON line, or None if it died or said nothing for `timeout` seconds."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def close(self):
        """End the worker process."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_HOST_INTRINSICS = {"x86_64": "x86", "AMD64": "x86", "aarch64": "arm_cpu", "arm64": "arm_cpu"}


def _register_cpu_intrinsics():
    """Register the tensor intrinsics MetaSchedule's rules for this CPU name, and only those.

    TuneContext imports tvm.s_tir.tensor_intrin, whose CUDA part alone takes
    tens of seconds to parse; a CPU tuner needs none of it. Seeding the package
    (with its real path) lets TuneContext's import find it already loaded.
    """
    name = "tvm.s_tir.tensor_intrin"
    host = _HOST_INTRINSICS.get(platform.machine())
    if name not in sys.modules and host is not None:
        package = importlib.util.module_from_spec(importlib.util.find_spec(name))
        sys.modules[name] = package
        importlib.import_module(f"{name}.{host}")


def _workload_hash(workload: tvm.IRModule) -> str:
    return str(ms.database.Workload(workload).as_json()[0])


def _mean(record):
    secs = [float(s) for s in record.run_secs or ()]
    return sum(secs) / len(secs) if secs else _FAILED


class Report:
    """What the tuning pass did in one compile."""

    def __init__(self):
        self.kernels = {}  # workload hash -> fingerprint of the records used (None: untuned)
        self.tuned = 0  # kernels tuned
        self.applied = 0  # kernels given a tuned schedule


class Tuner:
    """The tuning database in `work_dir` for `target`; tunes unseen kernels with `trials` trials (0: never)
    for programs that run on `cores` threads (None: all cores)."""

    def __init__(self, work_dir: str, target: tvm.target.Target, trials: int = 0, cores: int = None):
        self.work_dir = work_dir
        self.trials = trials
        # MetaSchedule's CPU rules size parallel loops by the core count, which the target must name.
        self.target = tvm.target.Target({**target.export(), "num-cores": cores or os.cpu_count() or 1})
        self._db = None
        self._records = None  # workload hash -> fingerprint of its records
        self._hashes = {}  # the database's workload objects -> their hash (hashing is costly)

    # ---- the database ---------------------------------------------------------------
    def database(self, create: bool = False):
        """The database, opened on first use; None if it does not exist and `create` is false."""
        if self._db is None and (create or os.path.isdir(self.work_dir)):
            # Private like the compile cache (makedirs gives only the leaf its mode).
            os.makedirs(os.path.dirname(self.work_dir), mode=0o700, exist_ok=True)
            os.makedirs(self.work_dir, mode=0o700, exist_ok=True)
            self._db = ms.database.JSONDatabase(work_dir=self.work_dir, allow_missing=True)
        return self._db

    def records(self) -> dict:
        """Workload hash -> fingerprint of its tuning records ('count:best seconds'), for every tuned kernel."""
        if self._records is None:
            db = self.database()
            groups = {}
            for rec in db.get_all_tuning_records() if db is not None else ():
                h = self._hashes.get(rec.workload)  # records share their workload's object
                if h is None:
                    h = self._hashes[rec.workload] = _workload_hash(rec.workload.mod)
                groups.setdefault(h, []).append(_mean(rec))
            self._records = {h: f"{len(ts)}:{min(ts):.3e}" for h, ts in groups.items()}
        return self._records

    def is_current(self, kernels) -> bool:
        """Whether a program compiled with `kernels` (hash -> fingerprint) would compile the same now."""
        if not kernels:
            return True
        records = self.records()
        if self.trials and any(h not in records for h in kernels):
            return False  # has kernels to tune
        return all(records.get(h) == fp for h, fp in kernels.items())

    # ---- tuning ---------------------------------------------------------------------
    def tune(self, kernels: dict, progress=None):
        """Tune `kernels` (workload hash -> (name, workload module)), one after another.

        `progress(name)` is called after each kernel.
        """
        _register_cpu_intrinsics()
        db = self.database(create=True)
        runner = _Runner()
        with tempfile.TemporaryDirectory(prefix="ratex-tune-") as tmp:
            builder = _Builder(tmp)
            try:
                for h, (name, workload) in kernels.items():
                    try:
                        self._tune_one(db, builder, runner, h, name, workload)
                    except Exception as err:  # noqa: BLE001 - the kernel keeps its default schedule
                        warnings.warn(f"ratex tuning: could not tune {name} ({type(err).__name__}: "
                                      f"{str(err)[:200]}); it keeps the default schedule", stacklevel=2)
                        self._commit_failed(db, workload)
                    if progress is not None:
                        progress(name)
            finally:
                runner.close()

    def _tune_one(self, db, builder, runner, h, name, workload):
        ctx = ms.TuneContext(
            mod=workload, target=self.target, space_generator="post-order-apply",
            search_strategy=self._search(), task_name=name, num_threads=1,
            logger=_quiet_logger(name),
        ).clone()
        ms.tune_tasks(
            tasks=[ctx], task_weights=[1.0], work_dir=self.work_dir,
            max_trials_global=self.trials, num_trials_per_iter=min(self.trials, 64),
            builder=builder, runner=runner, database=db, cost_model="random",
            measure_callbacks=[ms.measure_callback.AddToDatabase()],
        )
        self._commit_default(db, builder, runner, workload)
        self._records = None
        if h not in self.records():  # no candidate was even generated
            self._commit_failed(db, workload)

    def _commit_default(self, db, builder, runner, workload):
        """Measure the default schedule (schedules.py) too, as one more record.

        With few trials a random search can end below ratex's hand-written
        schedule; the database's best is then the default, never worse.
        """
        sch = default_schedule(workload["main"], self.target)
        if sch is None:
            return  # the default leaves this kernel unscheduled; any measured candidate is better
        (built,) = builder.build([ms.builder.BuilderInput(sch.mod, self.target)])
        if built.error_msg is not None:
            return
        args = ms.arg_info.ArgInfo.from_prim_func(workload["main"])
        (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, "llvm", args)])
        result = future.result()
        if result.error_msg is None:
            db.commit_tuning_record(ms.database.TuningRecord(
                sch.trace, db.commit_workload(workload), run_secs=list(result.run_secs), target=self.target,
                args_info=args,
            ))

    def _commit_failed(self, db, workload):
        """Record that `workload` has no tuned schedule, so later compiles do not tune it again.

        Queries skip failed records: the kernel keeps the default schedule.
        """
        db.commit_tuning_record(ms.database.TuningRecord(
            tvm.s_tir.schedule.Trace([], {}), db.commit_workload(workload), run_secs=[_FAILED], target=self.target,
        ))
        self._records = None

    def _search(self):
        # Without xgboost the cost model is random, so evolving a large population
        # buys nothing: sample a pool a few times the trials and measure from it.
        population = min(512, max(16, 8 * self.trials))
        return ms.search_strategy.EvolutionarySearch(
            population_size=population, init_min_unmeasured=population, genetic_num_iters=1,
        )

    def _schedule(self, workload, name):
        """The best record's schedule of `workload` replayed, or None (none usable)."""
        try:
            return self.database().query_schedule(workload, self.target, name)
        except Exception as err:  # noqa: BLE001 - a record that no longer replays: default schedule
            warnings.warn(f"ratex tuning: the record of {name} does not apply ({type(err).__name__}: "
                          f"{str(err)[:200]}); it keeps the default schedule", stacklevel=2)
            return None

    # ---- the pipeline pass ----------------------------------------------------------
    def pass_(self, report: Report, on_tune=None):
        """The pass that tunes (if enabled) and applies the database's records, noting what it did in `report`.

        `on_tune(count)` returns a context manager for tuning `count` new kernels
        that yields a per-kernel callback (progress bar, timing), or None.
        """

        @tvm.transform.module_pass(opt_level=0, name="RatexTuneAndApply")
        def apply(mod, _ctx):
            kernels = {}  # GlobalVar -> (workload, hash)
            for gv, func in mod.functions_items():
                if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled")):
                    workload = _normalize_mod(func)
                    kernels[gv] = (workload, _workload_hash(workload))
            if self.trials:
                todo = {}
                for gv, (workload, h) in kernels.items():
                    if h not in self.records():
                        todo.setdefault(h, (gv.name_hint, workload))
                if todo:
                    with on_tune(len(todo)) if on_tune else contextlib.nullcontext() as step:
                        self.tune(todo, step)
                    report.tuned += len(todo)
            records = self.records()
            for gv, (workload, h) in kernels.items():
                report.kernels[h] = records.get(h)
                sch = self._schedule(workload, gv.name_hint) if h in records else None
                if sch is not None:
                    func = sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)
                    mod.update_func(gv, func)
                    report.applied += 1
            return mod

        return apply


def _quiet_logger(name):
    """MetaSchedule logs each task's search at INFO; keep it out of the user's terminal."""
    logger = logging.getLogger(f"ratex.tuning.{name}")
    logger.setLevel(logging.WARNING)
    return logger
