"""freeze_heap: objects alive at the call leave the collector's full passes; later ones do not."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freeze_moves_start_up_objects_out_of_full_passes():
    # in a child process: a freeze in the test process would keep the suite's garbage forever
    code = textwrap.dedent(
        """
        import gc, time
        from specsched.engine.heap import freeze_heap
        keep = [[i] for i in range(200_000)]  # start-up state: tracked containers
        t = time.perf_counter(); gc.collect(); before = time.perf_counter() - t
        frozen = freeze_heap()
        assert frozen.num_frozen >= 200_000 and gc.get_freeze_count() == frozen.num_frozen
        t = time.perf_counter(); gc.collect(); after = time.perf_counter() - t
        later = [[i] for i in range(1000)]
        assert all(gc.is_tracked(x) for x in later) and gc.get_freeze_count() == frozen.num_frozen
        assert after < before / 3, (before, after)
        print("ok", frozen.description)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ") and "start-up objects frozen out of the GC" in out.stdout
