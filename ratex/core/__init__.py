"""The lazy device's core: IR, tracing, sync and execution, in layers that import only downwards.

  sync      sync.py: at a sync point, cut the pending graph, compile it or take it from
            the cache, launch it; ops whose rule fails run eagerly
  tracing   tracing/: an ATen call on lazy tensors becomes IR nodes, a view, a write,
            or an eager run (the package docstring gives the policy)
  tensor    tensor.py (LazyTensor), storage.py (values shared by a base and its views,
            the list of pending ones), chain.py (view chains replayed and scattered back)
  runtime   device.py (device data), launch.py (running programs off the tracing
            thread), executor.py (compiled programs), kernels.py (the kernel library),
            bounds.py (what a program's index checks found)
  ir        ir.py (nodes, values, argument templates), shape.py (shape inference),
            graph.py (graph cut, fx export), render.py (a graph as text), metrics.py,
            progress.py

Where a lower layer needs an upper one -- LazyTensor traces its ops with the tracer and
computes pending values with the sync layer -- the upper layer installs its entry point
into the lower one when it is imported (`tensor.install`); `import ratex` loads them all.
tests/test_layering.py keeps the layers (and prints them).
"""
