/* A stand-in libmimalloc for test_host_arena.cpp: mi_manage_os_memory_ex refuses every
 * region, as the real one does once the process's 64 arenas are in use (Note [When
 * mimalloc has no arena left] in tiering/host_arena.cpp). The other functions the arena
 * looks up exist so that loading succeeds; with no arena they are never reached.
 * tidepool_test_arena_refusals counts the regions offered. */
#include <stdbool.h>
#include <stddef.h>

int tidepool_test_arena_refusals = 0;

bool mi_manage_os_memory_ex(void* start, size_t size, bool is_committed, bool is_large,
                            bool is_zero, int numa_node, bool exclusive, int* arena_id) {
  (void)start, (void)size, (void)is_committed, (void)is_large, (void)is_zero;
  (void)numa_node, (void)exclusive, (void)arena_id;
  ++tidepool_test_arena_refusals;
  return false;
}
void* mi_heap_new_in_arena(int arena_id) { (void)arena_id; return NULL; }
void* mi_heap_malloc(void* heap, size_t size) { (void)heap, (void)size; return NULL; }
void* mi_heap_malloc_aligned(void* heap, size_t size, size_t alignment) {
  (void)heap, (void)size, (void)alignment;
  return NULL;
}
void mi_heap_delete(void* heap) { (void)heap; }
void mi_free(void* p) { (void)p; }
