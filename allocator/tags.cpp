// Tag registry (process-wide names <-> ids) and the per-thread tag stack.
//
// Names are written once into fixed slots and published with a release store of the
// count, so tag_name() reads without a lock; creation takes a mutex, which every fork
// takes too (Note [Tags across fork]).
#include "allocator/tags.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "allocator/config.h"
#include "allocator/json_text.h"

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
// destructor. current_tag() (every allocation) reads `top` alone. A thread that ends with
// its stack still deeper than that has the heap part freed by a pthread key's destructor
// (deeper_key), which costs no static TLS and nothing on the shallow path.
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

// Threads whose stack has a heap part now (tag_stacks_on_heap).
std::atomic<int> g_stacks_on_heap{0};

// Runs at the exit of a thread whose stack still has a heap part (glibc runs key
// destructors after thread_local destructors, so nothing pushes a tag afterwards): frees
// it and leaves the stack at its inline depth.
void free_deeper_at_thread_exit(void* deeper) {
  TagStack& s = t_stack;
  if (s.deeper == deeper) {
    s.deeper = nullptr;
    s.depth = TagStack::kInlineDepth;
    s.top = s.inline_tags[TagStack::kInlineDepth - 1];
  }
  delete[] static_cast<int*>(deeper);
  g_stacks_on_heap.fetch_sub(1, std::memory_order_relaxed);
}

// The key whose per-thread value is the thread's heap part, created when libtidepool is
// loaded (g_tag_fork_handlers), not by a first deep push a fork in another thread could
// interrupt: the child would wait for good on the one-time initialization's guard. Throws
// std::runtime_error when the process has no key left (then again at each deep push).
pthread_key_t deeper_key() {
  static const pthread_key_t key = [] {
    pthread_key_t k;
    if (const int err = pthread_key_create(&k, free_deeper_at_thread_exit); err != 0)
      throw std::runtime_error("tidepool: tag stack deeper than " +
                               std::to_string(TagStack::kInlineDepth) +
                               ": pthread_key_create failed (" + std::strerror(err) + ")");
    return k;
  }();
  return key;
}

// Note [Tags across fork]
// The tag stack is per thread and the names are read without a lock, so a process forked
// from one that uses tidepool can use tags as before (the calls that need the allocator
// it refuses, Note [Forked child] in fork_guard.h): a DataLoader worker, or CPU training
// under the fork start method (Hogwild), whose optimizer step the Python hooks run in a
// tag scope like any other step. All but the lock that looking up or creating a name
// takes: a child forked while another thread held it would find it held for good. So
// every fork takes it (pthread_atfork, registered when libtidepool is loaded): the
// forking thread locks it before the fork, the parent and the child unlock it after, and
// the child finds the table whole and the lock free. Nothing is waited for under it, so
// a fork waits at most for one lookup.
void lock_tags_for_fork() { registry().mutex.lock(); }
void unlock_tags_after_fork() { registry().mutex.unlock(); }

const bool g_tag_fork_handlers = [] {
  registry();  // made now, not by a first use a fork could interrupt
  try {
    deeper_key();  // likewise
  } catch (const std::runtime_error&) {  // no key left: said by the first deep push
  }
  pthread_atfork(&lock_tags_for_fork, &unlock_tags_after_fork, &unlock_tags_after_fork);
  return true;
}();

}  // namespace

int tag_id(std::string_view name) {
  if (name.empty()) throw std::invalid_argument("tidepool: tag name is empty");
  // The snapshot and the stats carry the names as JSON, whose text is UTF-8.
  if (!valid_utf8(name))
    throw std::invalid_argument("tidepool: tag name is not valid UTF-8: " + json_quoted(name));
  // tag_name hands the name out as a C string, which would end at the NUL.
  if (name.find('\0') != std::string_view::npos)
    throw std::invalid_argument("tidepool: tag name holds a NUL byte: " + json_quoted(name));
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
    if (s.deeper == nullptr) {
      // Set up before anything changes: a failure leaves the stack as it was.
      const pthread_key_t key = deeper_key();
      std::unique_ptr<int[]> deeper(new int[kMaxTagDepth - TagStack::kInlineDepth]);
      if (const int err = pthread_setspecific(key, deeper.get()); err != 0)
        throw std::runtime_error(std::string("tidepool: tag push: pthread_setspecific failed (") +
                                 std::strerror(err) + ")");
      s.deeper = deeper.release();
      g_stacks_on_heap.fetch_add(1, std::memory_order_relaxed);
    }
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
  // Freed as soon as the nesting is shallow again (and forgotten by the key, whose
  // destructor then has nothing to do at thread exit).
  if (s.depth == TagStack::kInlineDepth && s.deeper != nullptr) {
    pthread_setspecific(deeper_key(), nullptr);  // cannot fail: the key exists, the value is null
    delete[] s.deeper;
    s.deeper = nullptr;
    g_stacks_on_heap.fetch_sub(1, std::memory_order_relaxed);
  }
}

int current_tag() noexcept { return t_stack.top; }

int tag_depth() noexcept { return t_stack.depth; }

void end_tag_scope(int depth) noexcept {
  const int found = t_stack.depth;
  if (found != depth) {
    static std::atomic<bool> said{false};
    if (active_config().log != LogLevel::off && !said.exchange(true)) {
      std::fprintf(stderr,
                   "tidepool: a tag scope ended with the tag stack %d deep where its push left "
                   "it %d deep (%s); the stack is set back to what it was before the scope. "
                   "Said once.\n",
                   found, depth,
                   found > depth ? "pushes inside it were not popped"
                                 : "its own tag was popped inside it");
    }
  }
  // Each pop frees nothing but a deep stack's heap part, and cannot throw while depth > 0.
  while (t_stack.depth >= depth && t_stack.depth > 0) pop_tag();
}

int tag_stacks_on_heap() noexcept { return g_stacks_on_heap.load(std::memory_order_relaxed); }

}  // namespace tidepool
