// Tag registry (process-wide names <-> ids) and the per-thread tag stack.
//
// Names are written once into fixed slots and published with a release store of the
// count, so tag_name() reads without a lock; creation takes a mutex.
#include "allocator/tags.h"

#include <array>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

namespace tidepool {
namespace {

constexpr std::size_t kMaxTagNameLength = 63;

struct TagRegistry {
  std::array<std::string, kTagCount> names;
  std::atomic<int> count{0};
  std::mutex mutex;

  TagRegistry() {
    const char* builtins[] = {"untagged", "parameter", "gradient",
                              "activation", "optimizer_state", "workspace"};
    static_assert(std::size(builtins) == TIDEPOOL_TAG_FIRST_USER);
    for (int i = 0; i < TIDEPOOL_TAG_FIRST_USER; ++i) names[i] = builtins[i];
    count.store(TIDEPOOL_TAG_FIRST_USER, std::memory_order_release);
  }
};

TagRegistry& registry() {
  static TagRegistry* r = new TagRegistry();  // never destroyed: names outlive statics
  return *r;
}

// The calling thread's stack. Note [Static TLS] (thread_cache.cpp): libtidepool's whole
// TLS block lives in the static TLS that glibc keeps spare for dlopen()ed libraries, so
// it must stay small; the stack keeps its first kInlineDepth entries here and the rest,
// only while the nesting is that deep, on the heap. Constant-initialised and trivially
// destructible: reading it costs no TLS wrapper, and it is valid in any thread_local
// destructor. current_tag() (every allocation) reads `top` alone.
struct TagStack {
  static constexpr int kInlineDepth = 16;
  int depth = 0;
  int top = kTagUntagged;  // innermost tag; kTagUntagged when depth == 0
  std::array<int, kInlineDepth> inline_tags{};
  int* deeper = nullptr;  // entries kInlineDepth.. while depth > kInlineDepth

  int at(int i) const { return i < kInlineDepth ? inline_tags[i] : deeper[i - kInlineDepth]; }
};
static_assert(TagStack::kInlineDepth < kMaxTagDepth);
constinit thread_local TagStack t_stack [[gnu::tls_model("initial-exec")]]{};

}  // namespace

int tag_id(std::string_view name) {
  if (name.empty()) throw std::invalid_argument("tidepool: tag name is empty");
  if (name.size() > kMaxTagNameLength)
    throw std::invalid_argument("tidepool: tag name longer than 63 characters: '" +
                                std::string(name.substr(0, 32)) + "...'");
  TagRegistry& r = registry();
  std::lock_guard lock(r.mutex);
  const int n = r.count.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i)
    if (r.names[i] == name) return i;
  if (n >= kTagCount)
    throw std::length_error("tidepool: cannot create tag '" + std::string(name) + "': all " +
                            std::to_string(kTagCount) + " tag ids are in use");
  r.names[n] = std::string(name);
  r.count.store(n + 1, std::memory_order_release);
  return n;
}

const char* tag_name(int tag) {
  TagRegistry& r = registry();
  if (tag < 0 || tag >= r.count.load(std::memory_order_acquire)) return nullptr;
  return r.names[tag].c_str();
}

int tag_count() { return registry().count.load(std::memory_order_acquire); }

void push_tag(int tag) {
  if (tag < 0 || tag >= tag_count())
    throw std::invalid_argument("tidepool: push of unknown tag id " + std::to_string(tag));
  TagStack& s = t_stack;
  if (s.depth >= kMaxTagDepth)
    throw std::length_error("tidepool: tag stack deeper than " + std::to_string(kMaxTagDepth) +
                            " (a push without a pop?)");
  if (s.depth < TagStack::kInlineDepth) {
    s.inline_tags[s.depth] = tag;
  } else {
    // Allocated before anything changes: a bad_alloc leaves the stack as it was.
    if (s.deeper == nullptr) s.deeper = new int[kMaxTagDepth - TagStack::kInlineDepth];
    s.deeper[s.depth - TagStack::kInlineDepth] = tag;
  }
  ++s.depth;
  s.top = tag;
}

void pop_tag() {
  TagStack& s = t_stack;
  if (s.depth == 0) throw std::logic_error("tidepool: tag pop with an empty tag stack");
  --s.depth;
  s.top = s.depth == 0 ? kTagUntagged : s.at(s.depth - 1);
  // Freed as soon as the nesting is shallow again, so a thread that exits with its scopes
  // closed leaves nothing behind (the stack has no destructor, see above).
  if (s.depth == TagStack::kInlineDepth) {
    delete[] s.deeper;
    s.deeper = nullptr;
  }
}

int current_tag() noexcept { return t_stack.top; }

}  // namespace tidepool
