"""Persistent compile cache (RATEX_CACHE_DIR): reuse across processes, corruption, races, safety, size."""
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import tvm
from tvm import relax

from tvm_lowering import CompileCache, Options, disk_cache, resolve_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import torch, ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
d = lm.lazy_device()
x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(d)
y = ((x @ torch.ones(4, 2).to(d)) * 3 + 1).relu().sum(dim=0)
lm.mark_step()
print("RESULT", y.cpu().tolist())
for name in ("UncachedCompile", "CachedCompile", "PersistentCacheHit"):
    print(name, metrics.counter_value(name))
"""
EXPECTED = str(((torch.arange(12.0).reshape(3, 4) @ torch.ones(4, 2)) * 3 + 1).relu().sum(dim=0).tolist())


def _env(cache_dir, **extra):
    return dict(os.environ, RATEX_CACHE_DIR=str(cache_dir), **extra)


def _parse(stdout):
    out = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def _run(cache_dir, **extra):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(cache_dir, **extra), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = _parse(proc.stdout)
    assert out["RESULT"] == EXPECTED
    return out, proc.stderr


def _libs(cache_dir):
    return sorted(p for p in os.listdir(cache_dir) if p.endswith(".so"))


def _assert_one_good_entry(cache_dir):
    """Exactly one entry, whose library matches its metadata (what a later process would load)."""
    files = os.listdir(cache_dir)
    metas = [f for f in files if f.endswith(".json")]
    assert len(metas) == 1 and not [f for f in files if f.startswith(".tmp-")], files
    meta = json.loads((cache_dir / metas[0]).read_text())
    lib = (cache_dir / meta["lib"]).read_bytes()
    assert len(lib) == meta["size"] and hashlib.sha256(lib).hexdigest() == meta["sha256"]


def test_second_process_loads_from_disk(tmp_path):
    cache = tmp_path / "cache"
    first, _ = _run(cache)
    assert first["UncachedCompile"] == "1" and first["PersistentCacheHit"] == "None"
    assert len(_libs(cache)) == 1
    (meta_file,) = [p for p in os.listdir(cache) if p.endswith(".json")]
    meta = json.loads((cache / meta_file).read_text())
    assert meta["lib"] == _libs(cache)[0] and len(meta["sha256"]) == 64
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o700)
    second, _ = _run(cache)
    assert second["UncachedCompile"] in ("0", "None")
    assert int(second["PersistentCacheHit"]) > 0


def test_truncated_entry_is_recompiled_with_a_warning(tmp_path):
    cache = tmp_path / "cache"
    _run(cache)
    (lib,) = _libs(cache)
    path = cache / lib
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    out, err = _run(cache)
    assert "corrupt" in err and str(cache) in err
    assert out["UncachedCompile"] == "1" and out["PersistentCacheHit"] == "None"
    _assert_one_good_entry(cache)  # written anew


def test_two_processes_at_once_on_an_empty_dir(tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        assert _parse(stdout)["RESULT"] == EXPECTED
        assert "corrupt" not in stderr
    _assert_one_good_entry(cache)


def test_refuses_a_group_writable_dir(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(cache), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert str(cache) in proc.stderr and "writable by group/other" in proc.stderr
    assert os.listdir(cache) == []


def test_empty_cache_dir_disables(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out, _ = _run("", HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    assert out["UncachedCompile"] == "1"
    assert not (home / ".cache").exists()


# ---- unit tests of tvm_lowering.disk_cache (in process, no compiler) -----------------------
class _FakeExecutable:
    def __init__(self, payload: bytes):
        self.payload = payload

    def export_library(self, path):
        with open(path, "wb") as f:
            f.write(self.payload)


def test_stable_text():
    key = ((torch.float32, (3, 4)), torch.ops.aten.add.Tensor, 1, 1.0, True, None, "s")
    text = disk_cache.stable_text(key)
    assert "aten::add.Tensor" in text and "torch.float32" in text and "0x" not in text
    assert disk_cache.stable_text((1,)) != disk_cache.stable_text((1.0,)) != disk_cache.stable_text((True,))
    with pytest.raises(disk_cache.UnstableKey):
        disk_cache.stable_text((object(),))


def test_lru_eviction_by_size(tmp_path):
    cache = disk_cache.DiskCache(str(tmp_path / "c"), size_limit=3000, salt="t")
    names = [cache.name(("graph", i)) for i in range(3)]
    assert len(set(names)) == 3 and cache.name(("graph", 0)) == names[0]
    for i, name in enumerate(names[:2]):
        cache.store(name, _FakeExecutable(bytes([i]) * 1000))
        past = time.time() - 100 + i
        os.utime(os.path.join(cache.root, f"{name}.json"), (past, past))
    os.utime(os.path.join(cache.root, f"{names[0]}.json"))  # entry 0 used last: entry 1 is the LRU one
    cache.store(names[2], _FakeExecutable(b"\x02" * 1000))
    left = os.listdir(cache.root)
    assert any(f.startswith(names[0]) for f in left) and any(f.startswith(names[2]) for f in left)
    assert not any(f.startswith(names[1]) for f in left)
    assert sum(os.path.getsize(os.path.join(cache.root, f)) for f in left) <= 3000


def test_metadata_mismatch_is_dropped(tmp_path):
    cache = disk_cache.DiskCache(str(tmp_path / "c"), size_limit=1 << 20, salt="t")
    name = cache.name(("g",))
    cache.store(name, _FakeExecutable(b"\x7fELF not really"))
    meta_path = os.path.join(cache.root, f"{name}.json")
    meta = json.load(open(meta_path))
    meta["sha256"] = "0" * 64
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.warns(UserWarning, match="corrupt"):
        assert cache.load(name) is None
    assert os.listdir(cache.root) == []
    assert cache.load(name) is None  # now a plain miss


def test_bad_size_limit_env():
    proc = subprocess.run([sys.executable, "-c", "import ratex"], cwd=ROOT,
                          env=dict(os.environ, RATEX_CACHE_SIZE_MB="lots"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "RATEX_CACHE_SIZE_MB" in proc.stderr


def test_in_memory_cache_is_lru_and_its_last_hit_shortcut_forgets_nothing():
    """CompileCache answers a repeated key from its last hit without hashing; puts, evictions and
    clear still decide what it holds (keys are rebuilt each step: equal, never the same object)."""
    def key(n):
        return ("aliasing", (tuple(range(n)), (("aten::add.Tensor", n),)), ())

    cache = CompileCache(capacity=2)
    cache.put(key(1), "p1")
    cache.put(key(2), "p2")
    assert cache.get(key(1)) == "p1" and cache.get(key(1)) == "p1"  # the second from the last hit
    cache.put(key(3), "p3")  # evicts key 2, the least recently used
    assert cache.get(key(2)) is None
    assert cache.get(key(1)) == "p1" and cache.get(key(3)) == "p3"
    assert cache.get(key(3)) == "p3" and len(cache) == 2
    cache.clear()
    assert cache.get(key(3)) is None and len(cache) == 0


# ---- the cache object's disk tier (tvm_lowering.CompileCache), in process ------------------------
def _add_one():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([bb.emit(relax.op.add(x, relax.const(1.0, "float32")))]))
        bb.emit_func_output(out)
    return bb.get()


def test_disk_tier_is_shared_by_caches_with_the_same_salt_and_options(tmp_path):
    """A program stored by one cache is loaded by another attached to the same directory (as a later
    process would), and runs; other compile options, another version of the caller or no directory
    find nothing."""
    mod = _add_one()
    target, options, key = resolve_target("CPU"), Options(), ("graph", (4,), "add")
    first = CompileCache()
    first.attach(str(tmp_path), target, version="1")
    assert first.persists(key, options) and first.load(key, options) is None
    lib = first.store(key, options, first.build(mod, target, options), {"ops": 1})
    assert lib is not None

    second = CompileCache()
    second.attach(str(tmp_path), target, version="1")
    loaded = second.load(key, options)
    out = relax.VirtualMachine(loaded, tvm.cpu())["main"](tvm.runtime.tensor(torch.arange(4.0).numpy()))
    assert out[0].numpy().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert second.load(key, Options(schedule=False)) is None
    newer = CompileCache()
    newer.attach(str(tmp_path), target, version="2")
    assert newer.load(key, options) is None
    newer.attach(None, target)  # memory only
    assert not newer.persists(key, options) and newer.load(key, options) is None
    assert newer.store(key, options, first.build(mod, target, options)) is None
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".json")]) == 1


def test_an_entry_compiled_with_other_tuning_records_is_out_of_date(tmp_path):
    mod = _add_one()
    target, options = resolve_target("CPU"), Options()
    cache = CompileCache()
    cache.attach(str(tmp_path), target, version="1")
    built = cache.build(mod, target, options)
    assert cache.tuner is not None and built.report.kernels  # the add kernel, untuned: {hash: None}
    untuned, tuned = ("untuned",), ("tuned",)
    cache.store(untuned, options, built)
    built.report.kernels.update({h: "4:1.0e-06" for h in built.report.kernels})  # as if tuned since
    cache.store(tuned, options, built)
    assert cache.load(untuned, options) is not None
    assert cache.load(tuned, options) is None  # the database holds no such records (any more)
    tuning = CompileCache()
    tuning.attach(str(tmp_path), target, version="1", tune=2)
    assert tuning.load(untuned, options) is None  # its kernel is to be tuned first


def test_code_fingerprint_covers_whole_packages(tmp_path):
    pkg = tmp_path / "a" / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "mod.py").write_text("x = 1\n")
    (pkg / "sub" / "deep.py").write_text("y = 2\n")
    before = disk_cache.code_fingerprint([str(pkg)])
    (pkg / "sub" / "deep.py").write_text("y = 3\n")
    assert disk_cache.code_fingerprint([str(pkg)]) != before  # any module of the package counts
    (pkg / "sub" / "deep.py").write_text("y = 2\n")
    moved = tmp_path / "b" / "pkg"
    moved.parent.mkdir()
    pkg.rename(moved)
    assert disk_cache.code_fingerprint([str(moved)]) == before  # the same code elsewhere: the same entries
