// Pointer-stable migration: memory that PyTorch (or anyone) holds by pointer moves
// between device memory and host memory while the pointer stays the same.
//
// A VmmPool allocation is a reserved virtual range backed, through the seam's VA API, by
// physical chunks of whole 2 MiB granules (at most kChunkGranules per chunk, so a move is
// a few large copies rather than hundreds of small ones). migrate(ptr, to) moves every
// chunk not already in `to`:
//   1. wait until the streams that used the range (record_use) have passed their work;
//   2. create physical memory in `to`, map it at a scratch range, copy the chunk there;
//   3. unmap the chunk at the original address and map the new backing in its place;
//   4. release the old backing.
// The virtual address never changes. A failure at any step (no memory in `to`, a copy
// or map that fails) undoes that chunk's step and throws TieringError; chunks moved
// before the failure stay moved, and every byte stays readable at the same address.
//
// On the cuda backend `to == host` is CU_MEM_LOCATION_TYPE_HOST_NUMA memory the GPU
// reaches over the link; on the host backend memfd_create + mmap(MAP_FIXED), so this
// logic runs in CI.
//
// Thread-safety: every method may be called from any thread concurrently. Migrating a
// range while a stream uses it (after the last record_use) is a caller bug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"

namespace tidepool {

struct VmmStats {
  std::uint64_t ranges = 0;
  std::uint64_t device_backed_bytes = 0;
  std::uint64_t host_backed_bytes = 0;
  std::uint64_t migrations_to_host = 0;    // chunks moved
  std::uint64_t migrations_to_device = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_to_device = 0;
  double migration_ms = 0;  // wall time inside migrate(), waits for users excluded
  std::uint64_t failed_migrations = 0;
};

class TIDEPOOL_API VmmPool {
 public:
  static constexpr std::size_t kChunkGranules = 32;  // 64 MiB chunks at 2 MiB granularity

  explicit VmmPool(Backend& backend);
  // Frees every range still allocated.
  ~VmmPool();
  VmmPool(const VmmPool&) = delete;
  VmmPool& operator=(const VmmPool&) = delete;

  // A range of at least `bytes` (rounded up to whole granules) backed in `where`.
  // Returns nullptr when `where` is out of memory; throws TieringError for bad input
  // (bytes == 0) and BackendError-caused failures (as TieringError).
  void* allocate(std::size_t bytes, int tag, MemoryLocation where = MemoryLocation::device);
  // Pre: ptr came from allocate() and no stream still uses it. Throws TieringError for a
  // pointer the pool does not own.
  void deallocate(void* ptr);

  // Notes that work on `stream` uses the range holding `ptr`; migrate() waits for it.
  void record_use(const void* ptr, Stream stream);
  // Moves the whole range holding `ptr` to `to`, keeping its address. Throws TieringError.
  void migrate(const void* ptr, MemoryLocation to);
  // migrate() for every range with `tag`; returns the number of ranges moved.
  std::size_t migrate_tag(int tag, MemoryLocation to);

  bool owns(const void* ptr) const;
  // Base address and rounded size of the range holding `ptr` (nullptr/0 if none).
  void* base_of(const void* ptr) const;
  std::size_t size_of(const void* ptr) const;
  // Bytes of the range holding `ptr` backed in `where`.
  std::size_t bytes_in(const void* ptr, MemoryLocation where) const;

  VmmStats stats() const;
  Backend& backend() const { return backend_; }

 private:
  struct Chunk {
    std::size_t offset;
    std::size_t bytes;
    PhysicalHandle physical;
    MemoryLocation where;
  };
  struct Range {
    char* base = nullptr;
    std::size_t bytes = 0;
    int tag = 0;
    std::vector<Chunk> chunks;
    std::vector<Stream> use_streams;
  };

  Range* find_locked(const void* ptr);
  const Range* find_locked(const void* ptr) const;
  void wait_for_users_locked(Range& r);
  void migrate_chunk_locked(Range& r, Chunk& c, MemoryLocation to);
  void release_range_locked(Range& r);

  Backend& backend_;
  Stream stream_;
  Event sync_event_;
  void* scratch_ = nullptr;  // reserved VA of one full chunk, where new backing is filled
  std::size_t scratch_bytes_ = 0;
  mutable std::mutex mutex_;
  std::map<const char*, Range> ranges_;  // by base address
  VmmStats stats_;
};

}  // namespace tidepool
