/* A stand-in for the libcudart functions the LD_PRELOAD shim calls, so that the shim's
 * routing (cudaMalloc/cudaMallocAsync -> tidepool, cudaFree/cudaFreeAsync of its own
 * pointers -> tidepool, of anything else -> the real function) is tested on a machine
 * without a GPU. The shim is pointed at
 * it with TIDEPOOL_CUDART (or finds it in the global scope when the test loads it
 * RTLD_GLOBAL first); the counters let the test see which calls reached "CUDA".
 * "Device memory" here is plain malloc.
 *
 * Knobs, read from the environment at each call, for the cases a real runtime would need
 * other hardware or another toolkit for:
 *   FAKE_CUDART_VERSION  what cudaRuntimeGetVersion answers (default: the major of the
 *                        toolkit the tests were built with, FAKE_CUDART_DEFAULT_VERSION);
 *   FAKE_CUDART_DEVICE   what cudaGetDevice answers (default 0);
 *   FAKE_CUDART_STREAM_DEVICE  what cudaStreamGetDevice answers, for any stream (default:
 *                        FAKE_CUDART_DEVICE's answer, the current device);
 *   FAKE_CUDART_SYNC_ERROR  when set, what cudaDeviceSynchronize answers (e.g. 900,
 *                        cudaErrorStreamCaptureUnsupported: another thread captures);
 *   FAKE_CUDART_CAPTURING  when set, cudaStreamIsCapturing says every stream is being
 *                        captured into a graph;
 *   FAKE_CUDART_SYNC_OPENS_GATE  when set, cudaStreamSynchronize opens the host-streams
 *                        helper's gate first: a test holds a stream back, and only a wait
 *                        for it lets it pass (no timing);
 *   FAKE_CUDART_VERSION_DELAY_MS  cudaRuntimeGetVersion first sleeps that long, with
 *                        fake_cudart_version_query_running set meanwhile: the shim's
 *                        set-up (which asks it) is then under way for that long;
 *   FAKE_CUDART_NEST     when set, a cudaFree of a non-NULL pointer makes, before freeing,
 *                        the nested calls a runtime (or tidepool's cuda backend) may make
 *                        while the shim forwards to it: cudaFree(NULL), then cudaMalloc and
 *                        cudaMallocAsync, all through the process's symbols (the shim's).
 *                        Whether the two allocations reached this library is in
 *                        fake_cudart_nested_forwarded and fake_cudart_nested_async_forwarded;
 *   FAKE_CUDART_OTHER_OOM  N: the first N of the other allocations (cudaMallocPitch,
 *                        cudaMallocManaged, cudaMallocFromPoolAsync) answer
 *                        cudaErrorMemoryAllocation (default 0);
 *   FAKE_CUDART_MALLOC_AT  when set (an address, as strtoull reads it with base 0), cudaMalloc
 *                        hands out that address instead of memory of its own, as a new
 *                        context after cudaDeviceReset may hand out addresses the old one
 *                        used (nothing is behind it: only freed, never read or written);
 *   FAKE_CUDART_FREE_MIB, FAKE_CUDART_TOTAL_MIB  what cudaMemGetInfo answers, in MiB
 *                        (default 1024 free of 4096).
 *
 * Memory: the fake remembers what its cudaMalloc and cudaMallocAsync (and _ptsz) handed out
 * and not yet freed; as the runtime, a free of any other non-NULL pointer is answered
 * cudaErrorInvalidValue (and does not reach free()).
 *
 * Streams: cudaStreamCreate hands out the same handle every time (FAKE_CUDART_STREAM_HANDLE,
 * default 0x5200), as CUDA may give a destroyed stream's handle to the next stream. When
 * the test helper library (host_streams.cpp) is loaded, each handle is a stream of
 * tidepool's host backend instead, on the current device, which tidepool can wait for as
 * CUDA's tidepool waits for the program's streams; cudaStreamGetDevice answers its device,
 * events and waits work across devices as CUDA's do, and cudaStreamDestroy destroys it,
 * unless FAKE_CUDART_REUSE_HANDLES is set: then the next cudaStreamCreate hands the
 * destroyed handle out again (as a new stream; its host stream is kept, as CUDA may reuse
 * a handle). Without the helper the event functions answer cudaErrorNotSupported, and
 * cudaStreamSynchronize succeeds at once (no stream has work).
 * cudaStreamDestroy records, in fake_cudart_destroy_saw_tidepool_stream, whether
 * tidepool's snapshot still named the handle at that moment (1) or not (0).
 * cudaSetDevice makes devices 0 to 3 current (it sets FAKE_CUDART_DEVICE).
 *
 * Last error: as the runtime, every call that fails leaves its error as the calling
 * thread's last error, which cudaGetLastError returns and resets and cudaPeekAtLastError
 * returns; a success leaves it as it was. cudaErrorNotReady from cudaEventQuery counts
 * as an error here, as tidepool's cuda backend and PyTorch assume of the runtime (they
 * clear it after such a query). A NULL devPtr is cudaErrorInvalidValue, as the runtime's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef FAKE_CUDART_DEFAULT_VERSION
#define FAKE_CUDART_DEFAULT_VERSION 13000
#endif

int fake_cudart_malloc_calls = 0;
int fake_cudart_free_calls = 0;
int fake_cudart_malloc_async_calls = 0;
int fake_cudart_free_async_calls = 0;
int fake_cudart_synchronize_calls = 0;
int fake_cudart_nested_forwarded = -1; /* -1: no nested call made yet */
int fake_cudart_nested_async_forwarded = -1;
int fake_cudart_stream_create_calls = 0;
int fake_cudart_stream_destroy_calls = 0;
int fake_cudart_destroy_saw_tidepool_stream = -1; /* -1: no destroy yet */
int fake_cudart_event_creates = 0;
int fake_cudart_event_records = 0;
int fake_cudart_stream_synchronize_calls = 0;
int fake_cudart_malloc_async_ptsz_calls = 0;
int fake_cudart_free_async_ptsz_calls = 0;
/* The stream a _ptsz function was last given: the program's own argument must arrive. */
intptr_t fake_cudart_last_ptsz_stream = -1;

static __thread int last_error = 0;

/* Every fallible function returns through here. */
static int answer(int rc) {
  if (rc != 0) last_error = rc;
  return rc;
}

int cudaGetLastError(void) {
  const int rc = last_error;
  last_error = 0;
  return rc;
}

int cudaPeekAtLastError(void) { return last_error; }

static int env_int(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != NULL && *value != '\0' ? atoi(value) : fallback;
}

/* What the fake handed out and was not given back (see the top): a list, under a lock
 * (the shim forwards from any thread). `backed`: from malloc(), so free() takes it back. */
struct handed_out {
  void* ptr;
  int backed;
  struct handed_out* next;
};
static struct handed_out* handed_out_list = NULL;
static pthread_mutex_t handed_out_mutex = PTHREAD_MUTEX_INITIALIZER;

/* Remembers `ptr` (when not NULL); 0, or 2 (cudaErrorMemoryAllocation) when it cannot. */
static int hand_out(void* ptr, int backed) {
  if (ptr == NULL) return 0;
  struct handed_out* entry = malloc(sizeof *entry);
  if (entry == NULL) {
    if (backed) free(ptr);
    return 2;
  }
  entry->ptr = ptr;
  entry->backed = backed;
  pthread_mutex_lock(&handed_out_mutex);
  entry->next = handed_out_list;
  handed_out_list = entry;
  pthread_mutex_unlock(&handed_out_mutex);
  return 0;
}

/* Takes back what the fake handed out at `ptr`: 0, or 1 (cudaErrorInvalidValue) for a
 * pointer it did not hand out or already took back. NULL is 0, as the runtime's. */
static int take_back(void* ptr) {
  if (ptr == NULL) return 0;
  pthread_mutex_lock(&handed_out_mutex);
  struct handed_out** link = &handed_out_list;
  while (*link != NULL && (*link)->ptr != ptr) link = &(*link)->next;
  struct handed_out* entry = *link;
  if (entry != NULL) *link = entry->next;
  pthread_mutex_unlock(&handed_out_mutex);
  if (entry == NULL) return 1;
  if (entry->backed) free(ptr);
  free(entry);
  return 0;
}

/* Memory of `size` bytes, remembered: 0, or cudaErrorMemoryAllocation. */
static int fake_allocate(void** ptr, size_t size) {
  *ptr = malloc(size);
  if (*ptr == NULL && size != 0) return 2; /* cudaErrorMemoryAllocation */
  const int rc = hand_out(*ptr, 1);
  if (rc != 0) *ptr = NULL;
  return rc;
}

int cudaMalloc(void** ptr, size_t size) {
  ++fake_cudart_malloc_calls;
  if (ptr == NULL) return answer(1); /* cudaErrorInvalidValue */
  const char* at = getenv("FAKE_CUDART_MALLOC_AT");
  if (at != NULL && *at != '\0') {
    *ptr = (void*)(uintptr_t)strtoull(at, NULL, 0);
    return answer(hand_out(*ptr, 0));
  }
  const int rc = fake_allocate(ptr, size);
  if (rc == 0 && *ptr == NULL) return answer(2); /* malloc(0) gave NULL: as before */
  return answer(rc);
}

int fake_cudart_resets = 0;

int cudaDeviceReset(void) {
  ++fake_cudart_resets;
  return 0;
}

int fake_cudart_ipc_exports = 0;

/* cudaIpcMemHandle_t is 64 opaque bytes; the fake writes the pointer into the first 8. */
int cudaIpcGetMemHandle(void* handle, void* ptr) {
  ++fake_cudart_ipc_exports;
  memcpy(handle, &ptr, sizeof ptr);
  return 0;
}

int cudaFree(void* ptr) {
  static int depth = 0; /* the nested cudaFree(NULL) comes back here: nest only once */
  ++fake_cudart_free_calls;
  if (ptr != NULL && depth == 0 && getenv("FAKE_CUDART_NEST") != NULL) {
    int (*process_free)(void*) = (int (*)(void*))dlsym(RTLD_DEFAULT, "cudaFree");
    int (*process_malloc)(void**, size_t) =
        (int (*)(void**, size_t))dlsym(RTLD_DEFAULT, "cudaMalloc");
    int (*process_malloc_async)(void**, size_t, void*) =
        (int (*)(void**, size_t, void*))dlsym(RTLD_DEFAULT, "cudaMallocAsync");
    ++depth;
    process_free(NULL);
    const int before = fake_cudart_malloc_calls;
    void* nested = NULL;
    process_malloc(&nested, 64);
    fake_cudart_nested_forwarded = fake_cudart_malloc_calls - before;
    const int before_async = fake_cudart_malloc_async_calls;
    void* nested_async = NULL;
    process_malloc_async(&nested_async, 64, NULL);
    fake_cudart_nested_async_forwarded = fake_cudart_malloc_async_calls - before_async;
    --depth;
    /* Memory from this library goes back here; tidepool's (the bug) is left to exit. */
    if (fake_cudart_nested_forwarded == 1) take_back(nested);
    if (fake_cudart_nested_async_forwarded == 1) take_back(nested_async);
  }
  return answer(take_back(ptr));
}

int cudaMallocAsync(void** ptr, size_t size, void* stream) {
  (void)stream;
  ++fake_cudart_malloc_async_calls;
  if (ptr == NULL) return answer(1); /* cudaErrorInvalidValue */
  return answer(fake_allocate(ptr, size));
}

int cudaFreeAsync(void* ptr, void* stream) {
  (void)stream;
  ++fake_cudart_free_async_calls;
  return answer(take_back(ptr));
}

/* The per-thread default stream forms (nvcc --default-stream per-thread). */
int cudaMallocAsync_ptsz(void** ptr, size_t size, void* stream) {
  ++fake_cudart_malloc_async_ptsz_calls;
  fake_cudart_last_ptsz_stream = (intptr_t)stream;
  if (ptr == NULL) return answer(1); /* cudaErrorInvalidValue */
  return answer(fake_allocate(ptr, size));
}

int cudaFreeAsync_ptsz(void* ptr, void* stream) {
  ++fake_cudart_free_async_ptsz_calls;
  fake_cudart_last_ptsz_stream = (intptr_t)stream;
  return answer(take_back(ptr));
}

/* The other allocations and the memory-pool calls the shim watches (Note [calls the shim
 * watches] in preload/watched_calls.cpp), each counted in fake_cudart_other_malloc_calls.
 * FAKE_CUDART_OTHER_OOM=N: the first N of them (whichever) answer
 * cudaErrorMemoryAllocation, as a device whose memory is in tidepool's cache would. */
int fake_cudart_other_malloc_calls = 0;
static atomic_int other_calls_seen = 0;

static int other_allocation(void** ptr, size_t size) {
  ++fake_cudart_other_malloc_calls;
  if (ptr == NULL) return answer(1); /* cudaErrorInvalidValue */
  if (atomic_fetch_add(&other_calls_seen, 1) < env_int("FAKE_CUDART_OTHER_OOM", 0)) {
    return answer(2); /* cudaErrorMemoryAllocation */
  }
  return answer(fake_allocate(ptr, size));
}

int cudaMallocPitch(void** ptr, size_t* pitch, size_t width, size_t height) {
  if (pitch != NULL) *pitch = width;
  return other_allocation(ptr, width * height);
}

int cudaMallocManaged(void** ptr, size_t size, unsigned flags) {
  (void)flags;
  return other_allocation(ptr, size);
}

int cudaMallocFromPoolAsync(void** ptr, size_t size, void* pool, void* stream) {
  (void)pool;
  (void)stream;
  return other_allocation(ptr, size);
}

int cudaMallocFromPoolAsync_ptsz(void** ptr, size_t size, void* pool, void* stream) {
  (void)pool;
  (void)stream;
  return other_allocation(ptr, size);
}

/* Devices 0-3 (as cudaSetDevice), whose default pools are the handles 0x7000 + device. The
 * fake's cudaMallocAsync allocates as before whatever the current pool is: a test sees
 * which calls reached it. */
int fake_cudart_set_mem_pool_calls = 0;
int fake_cudart_pool_access_calls = 0;

int cudaDeviceGetDefaultMemPool(void** pool, int device) {
  if (pool == NULL) return answer(1);
  if (device < 0 || device > 3) return answer(101); /* cudaErrorInvalidDevice */
  *pool = (void*)(uintptr_t)(0x7000 + device);
  return 0;
}

int cudaDeviceSetMemPool(int device, void* pool) {
  (void)pool;
  ++fake_cudart_set_mem_pool_calls;
  return device < 0 || device > 3 ? answer(101) : 0;
}

int cudaMemPoolSetAccess(void* pool, const void* map, size_t count) {
  (void)pool;
  (void)map;
  (void)count;
  ++fake_cudart_pool_access_calls;
  return 0;
}

/* Peer access among devices 0-3, as the runtime grants it: from the current device to
 * `peer`; a second grant of the same pair is cudaErrorPeerAccessAlreadyEnabled. */
int fake_cudart_peer_access_calls = 0;
static unsigned peer_granted[4]; /* bit p of [d]: device d may access device p */

int cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  ++fake_cudart_peer_access_calls;
  const int current = env_int("FAKE_CUDART_DEVICE", 0);
  if (flags != 0) return answer(1);                                          /* InvalidValue */
  if (peer < 0 || peer > 3 || peer == current || current < 0 || current > 3) return answer(101);
  if (peer_granted[current] >> peer & 1u) return answer(704); /* PeerAccessAlreadyEnabled */
  peer_granted[current] |= 1u << peer;
  return 0;
}

/* FAKE_CUDART_DEVICE_COUNT devices (default none: cudaErrorNoDevice), as a machine with
 * GPUs: the LD_PRELOAD shim serves with tidepool's host backend only where the runtime
 * sees none (Note [device memory only] in preload/libraries.cpp). */
int cudaGetDeviceCount(int* count) {
  const int devices = env_int("FAKE_CUDART_DEVICE_COUNT", 0);
  if (devices <= 0) return answer(100); /* cudaErrorNoDevice */
  *count = devices;
  return 0;
}

int fake_cudart_mem_get_info_calls = 0;
int cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  ++fake_cudart_mem_get_info_calls;
  if (free_bytes == NULL || total_bytes == NULL) return answer(1); /* cudaErrorInvalidValue */
  *free_bytes = (size_t)env_int("FAKE_CUDART_FREE_MIB", 1024) << 20;
  *total_bytes = (size_t)env_int("FAKE_CUDART_TOTAL_MIB", 4096) << 20;
  return 0;
}

/* The helper library's function `name`, or NULL when the test did not load it. */
static void* helper(const char* name) { return dlsym(RTLD_DEFAULT, name); }

int cudaStreamGetDevice(void* stream, int* device) {
  int (*host_device)(void*) = (int (*)(void*))helper("host_streams_device");
  const int known = host_device != NULL ? host_device(stream) : -1;
  if (known >= 0) {
    *device = known;
    return 0;
  }
  *device = env_int("FAKE_CUDART_STREAM_DEVICE", env_int("FAKE_CUDART_DEVICE", 0));
  return 0;
}

int cudaStreamIsCapturing(void* stream, int* status) {
  (void)stream;
  *status = getenv("FAKE_CUDART_CAPTURING") != NULL; /* cudaStreamCaptureStatusActive */
  return 0;
}

int cudaGetDevice(int* device) {
  *device = env_int("FAKE_CUDART_DEVICE", 0);
  return 0;
}

int cudaSetDevice(int device) {
  if (device < 0 || device > 3) return answer(101); /* cudaErrorInvalidDevice */
  char value[16];
  snprintf(value, sizeof value, "%d", device);
  setenv("FAKE_CUDART_DEVICE", value, 1);
  return 0;
}

int cudaDeviceSynchronize(void) {
  ++fake_cudart_synchronize_calls;
  const int error = env_int("FAKE_CUDART_SYNC_ERROR", 0);
  return error != 0 ? answer(error) : 0;
}

/* Non-zero while a cudaRuntimeGetVersion that FAKE_CUDART_VERSION_DELAY_MS slows down runs. */
atomic_int fake_cudart_version_query_running;
/* How many such slowed-down queries have started: a test waiting for one to be under way
 * polls this, which stays set, as a poll of the flag above may miss its whole window. */
atomic_int fake_cudart_version_queries_started;

int cudaRuntimeGetVersion(int* version) {
  const int delay_ms = env_int("FAKE_CUDART_VERSION_DELAY_MS", 0);
  if (delay_ms > 0) {
    atomic_store(&fake_cudart_version_query_running, 1);
    atomic_fetch_add(&fake_cudart_version_queries_started, 1);
    const struct timespec pause = {delay_ms / 1000, (long)(delay_ms % 1000) * 1000000L};
    nanosleep(&pause, NULL);
    atomic_store(&fake_cudart_version_query_running, 0);
  }
  *version = env_int("FAKE_CUDART_VERSION", FAKE_CUDART_DEFAULT_VERSION);
  return 0;
}

static void* reusable_handle = NULL; /* FAKE_CUDART_REUSE_HANDLES: the last destroyed */

int cudaStreamCreate(void** stream) {
  void* (*host_create)(int) = (void* (*)(int))helper("host_streams_create");
  ++fake_cudart_stream_create_calls;
  if (host_create == NULL) {
    *stream = (void*)(uintptr_t)env_int("FAKE_CUDART_STREAM_HANDLE", 0x5200);
  } else if (reusable_handle != NULL) {
    *stream = reusable_handle;
    reusable_handle = NULL;
  } else {
    *stream = host_create(env_int("FAKE_CUDART_DEVICE", 0));
  }
  return 0;
}

int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  (void)flags;
  return cudaStreamCreate(stream);
}

int cudaEventCreateWithFlags(void** event, unsigned flags) {
  void* (*host_create)(void) = (void* (*)(void))helper("host_events_create");
  (void)flags;
  ++fake_cudart_event_creates;
  if (host_create == NULL) return answer(801); /* cudaErrorNotSupported */
  *event = host_create();
  return 0;
}

int cudaEventRecord(void* event, void* stream) {
  int (*host_record)(void*, void*, int) = (int (*)(void*, void*, int))helper("host_events_record");
  ++fake_cudart_event_records;
  return answer(host_record != NULL ? host_record(event, stream, env_int("FAKE_CUDART_DEVICE", 0))
                                    : 801);
}

int cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  int (*host_wait)(void*, void*, int) =
      (int (*)(void*, void*, int))helper("host_streams_wait_event");
  (void)flags;
  return answer(host_wait != NULL ? host_wait(stream, event, env_int("FAKE_CUDART_DEVICE", 0))
                                  : 801);
}

int cudaEventQuery(void* event) {
  int (*host_query)(void*) = (int (*)(void*))helper("host_events_query");
  return answer(host_query != NULL ? host_query(event) : 801);
}

int cudaStreamSynchronize(void* stream) {
  int (*host_sync)(void*, int) = (int (*)(void*, int))helper("host_streams_synchronize");
  void (*host_open)(void) = (void (*)(void))helper("host_streams_open");
  ++fake_cudart_stream_synchronize_calls;
  if (host_open != NULL && getenv("FAKE_CUDART_SYNC_OPENS_GATE") != NULL) host_open();
  return answer(host_sync != NULL ? host_sync(stream, env_int("FAKE_CUDART_DEVICE", 0)) : 0);
}

int cudaEventDestroy(void* event) {
  void (*host_destroy)(void*) = (void (*)(void*))helper("host_events_destroy");
  if (host_destroy == NULL) return answer(801);
  host_destroy(event);
  return 0;
}

/* Whether tidepool's snapshot of device 0 names `stream` as a segment's or block's. */
static int tidepool_names(void* stream) {
  char* (*snapshot)(int) = (char* (*)(int))dlsym(RTLD_DEFAULT, "tidepool_snapshot_json");
  void (*string_free)(char*) = (void (*)(char*))dlsym(RTLD_DEFAULT, "tidepool_string_free");
  if (snapshot == NULL || string_free == NULL) return 0;
  char* json = snapshot(0);
  if (json == NULL) return 0;
  char key[64];
  snprintf(key, sizeof key, "\"stream\":\"0x%" PRIxPTR "\"", (uintptr_t)stream);
  const int named = strstr(json, key) != NULL;
  string_free(json);
  return named;
}

int cudaStreamDestroy(void* stream) {
  void (*host_destroy)(void*) = (void (*)(void*))helper("host_streams_destroy");
  ++fake_cudart_stream_destroy_calls;
  fake_cudart_destroy_saw_tidepool_stream = tidepool_names(stream);
  if (host_destroy != NULL && getenv("FAKE_CUDART_REUSE_HANDLES") != NULL) {
    reusable_handle = stream;
  } else if (host_destroy != NULL) {
    host_destroy(stream);
  }
  return 0;
}

/* A thread that allocates and frees through the process's cudaMalloc and cudaFree (the
 * shim's, when it is preloaded) without pause, from fake_cudart_churn_start until
 * fake_cudart_churn_stop: at any moment a thread is inside the shim, often holding its
 * locks, as a training process's allocating threads are when another thread forks. Plain
 * C, so that it never waits for Python's lock. fake_cudart_churn_rounds counts its
 * allocate-and-free rounds. */
static pthread_t churn_thread;
static atomic_int churn_stopping;
atomic_long fake_cudart_churn_rounds;

static void* churn(void* unused) {
  int (*process_malloc)(void**, size_t) =
      (int (*)(void**, size_t))dlsym(RTLD_DEFAULT, "cudaMalloc");
  int (*process_free)(void*) = (int (*)(void*))dlsym(RTLD_DEFAULT, "cudaFree");
  (void)unused;
  while (!atomic_load(&churn_stopping)) {
    void* p = NULL;
    if (process_malloc(&p, 4096) == 0) process_free(p);
    atomic_fetch_add(&fake_cudart_churn_rounds, 1);
  }
  return NULL;
}

int fake_cudart_churn_start(void) {
  atomic_store(&churn_stopping, 0);
  return pthread_create(&churn_thread, NULL, churn, NULL);
}

void fake_cudart_churn_stop(void) {
  atomic_store(&churn_stopping, 1);
  pthread_join(churn_thread, NULL);
}
