"""The LD_PRELOAD shim in a process forked after tidepool allocated (Note [Forked child
under the shim] in preload/fork_handlers.cpp), against the stand-in libcudart and the real
libtidepool on its host backend: frees of the shim's pointers succeed with no CUDA call,
everything else reaches the runtime unchanged, a parent thread inside the shim (or inside
its set-up) at the fork never hangs the child, and the parent goes on as before."""

from __future__ import annotations

from preload_fake import needs_fake, needs_preload, run_with_fake

pytestmark = [needs_preload, needs_fake]

# Forks once, runs CHILD in the child (which fills `child`), and leaves the child's report
# and exit status in `out`. The child reports through a pipe: its stdout is the parent's.
FORK = """
def fork_and_report(child_code):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        child = {}
        exec(child_code, {**globals(), "child": child})
        os.write(write_end, json.dumps(child).encode())
        os._exit(0)
    os.close(write_end)
    data = b""
    while True:
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        data += chunk
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return json.loads(data or b"null"), status
"""


def test_a_forked_child_frees_the_parents_memory_without_cuda_and_forwards_the_rest(run_python):
    out, stderr = run_with_fake(run_python, FORK + """
import tidepool
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"]
p, q = c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["malloc_async_rc"] = process.cudaMallocAsync(byref(q), 1 << 20, None)
before = allocated()
out["child"], out["child_status"] = fork_and_report('''
calls = lambda: {name: counter("fake_cudart_" + name) for name in
                 ("malloc_calls", "free_calls", "free_async_calls", "synchronize_calls",
                  "stream_destroy_calls")}
start = calls()
child["free_rc"] = process.cudaFree(p)
child["free_async_rc"] = process.cudaFreeAsync(q, None)
after_frees = calls()
child["runtime_calls_by_frees"] = {k: after_frees[k] - start[k] for k in start}
f = c_void_p()
child["malloc_rc"] = process.cudaMalloc(byref(f), 4096)
child["foreign_free_rc"] = process.cudaFree(f)
child["destroy_rc"] = process.cudaStreamDestroy(c_void_p(0x5200))
end = calls()
child["runtime_calls_after"] = {k: end[k] - after_frees[k] for k in start}
''')
out["parent_still_allocated"] = allocated() == before
out["parent_free_rc"] = process.cudaFree(p)
out["parent_free_async_rc"] = process.cudaFreeAsync(q, None)
out["parent_allocated_after"] = allocated()
""", TIDEPOOL_BACKEND="host")
    assert out["child_status"] == 0, stderr
    assert out["child"] == {
        "free_rc": 0, "free_async_rc": 0,
        # Neither free reached the runtime, not even cudaFree's device synchronisation.
        "runtime_calls_by_frees": {"malloc_calls": 0, "free_calls": 0, "free_async_calls": 0,
                                   "synchronize_calls": 0, "stream_destroy_calls": 0},
        # The runtime answers the rest (the stand-in allocates; CUDA's would refuse).
        "malloc_rc": 0, "foreign_free_rc": 0, "destroy_rc": 0,
        "runtime_calls_after": {"malloc_calls": 1, "free_calls": 1, "free_async_calls": 0,
                                "synchronize_calls": 0, "stream_destroy_calls": 1},
    }
    assert "could not release" not in stderr
    assert out["malloc_rc"] == 0 and out["malloc_async_rc"] == 0
    assert out["parent_still_allocated"]
    assert out["parent_free_rc"] == 0 and out["parent_free_async_rc"] == 0
    assert out["parent_allocated_after"] == 0


def test_a_parent_thread_inside_the_shim_at_the_fork_never_hangs_the_child(run_python):
    # A thread of the stand-in runtime allocates and frees through the shim without pause
    # while the main thread forks: at many forks it holds one of the shim's locks. Each
    # child frees a pointer the shim handed out (which looks it up under that lock) and
    # exits. One that has not exited 5 s later hangs on a lock no thread will release: it
    # is killed, and the forking stops there.
    out, stderr = run_with_fake(run_python, """
import signal, time
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["churn_rc"] = fake.fake_cudart_churn_start()
hung, failed = 0, 0
for _ in range(200):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if process.cudaFree(p) == 0 else 1)
    deadline = time.monotonic() + 5
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            failed += status != 0
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.001)
    if hung:
        break
fake.fake_cudart_churn_stop()
out["hung"], out["failed"] = hung, failed
out["churned"] = ctypes.c_long.in_dll(fake, "fake_cudart_churn_rounds").value > 0
out["free_rc"] = process.cudaFree(p)
""", TIDEPOOL_BACKEND="host", timeout=300)
    assert out == {"malloc_rc": 0, "churn_rc": 0, "hung": 0, "failed": 0, "churned": True,
                   "free_rc": 0}, stderr


def test_a_fork_while_another_thread_sets_the_shim_up_never_hangs_the_child(run_python):
    # A thread's first cudaMalloc sets the shim up (the stand-in runtime's version query
    # takes 1 s of it) while the main thread forks: the child's own cudaMalloc must not
    # wait for a set-up no thread of it is running. The fork waits for the set-up, and the
    # child finds it done (its cudaMalloc then goes to the runtime or, when the fork came
    # before the parent's allocator, to a tidepool of its own: either succeeds).
    out, stderr = run_with_fake(run_python, """
import signal, threading, time
result = {}
def first_malloc():
    r = c_void_p()
    result["rc"] = process.cudaMalloc(byref(r), 4096)
worker = threading.Thread(target=first_malloc)
worker.start()
deadline = time.monotonic() + 30
while not ctypes.c_int.in_dll(fake, "fake_cudart_version_queries_started").value:
    assert time.monotonic() < deadline, "the set-up never started"
    time.sleep(0.001)
pid = os.fork()
if pid == 0:
    r = c_void_p()
    os._exit(0 if process.cudaMalloc(byref(r), 4096) == 0 else 1)
deadline = time.monotonic() + 15
status = None
while status is None:
    done, code = os.waitpid(pid, os.WNOHANG)
    if done:
        status = code
    elif time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = "hung"
    else:
        time.sleep(0.01)
worker.join()
out["child"] = status
out["parent_malloc_rc"] = result["rc"]
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_VERSION_DELAY_MS="1000", timeout=120)
    assert out == {"child": 0, "parent_malloc_rc": 0}, stderr
