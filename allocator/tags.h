// Allocation tags: every allocation carries the id of the innermost tag of the calling
// thread's tag stack, so stats can say how much memory parameters, gradients,
// activations, optimizer state or any user-named category hold.
//
// Ids 0..TIDEPOOL_TAG_FIRST_USER-1 are the built-ins of allocator/c_api.h; user names get
// the next free id on first use, up to TIDEPOOL_TAG_MAX. The stack is thread-local: a
// TagScope (C++) or tidepool_tag_push/pop (C) affects only the calling thread.
#pragma once

#include <string_view>

#include "allocator/c_api.h"
#include "allocator/export.h"

namespace tidepool {

inline constexpr int kTagUntagged = TIDEPOOL_TAG_UNTAGGED;
inline constexpr int kTagParameter = TIDEPOOL_TAG_PARAMETER;
inline constexpr int kTagGradient = TIDEPOOL_TAG_GRADIENT;
inline constexpr int kTagActivation = TIDEPOOL_TAG_ACTIVATION;
inline constexpr int kTagOptimizerState = TIDEPOOL_TAG_OPTIMIZER_STATE;
inline constexpr int kTagWorkspace = TIDEPOOL_TAG_WORKSPACE;
inline constexpr int kTagCount = TIDEPOOL_TAG_MAX;
// Deepest tag nesting per thread; deeper pushes are rejected (a missing pop, a loop).
inline constexpr int kMaxTagDepth = 256;

// Id for `name` (a built-in or user name), created on first use. Throws
// std::invalid_argument for an empty or over-long (> 63 chars) name and
// std::length_error when all TIDEPOOL_TAG_MAX ids are taken.
TIDEPOOL_API int tag_id(std::string_view name);
// Name of `tag`, or nullptr when no such tag exists. The string lives forever.
TIDEPOOL_API const char* tag_name(int tag);
// Number of tag ids in use (built-ins included).
TIDEPOOL_API int tag_count();

// Thread-local stack. push_tag throws std::invalid_argument for an unknown id and
// std::length_error past kMaxTagDepth; pop_tag throws std::logic_error when empty.
TIDEPOOL_API void push_tag(int tag);
TIDEPOOL_API void pop_tag();
// Innermost tag of this thread, kTagUntagged when the stack is empty.
TIDEPOOL_API int current_tag() noexcept;
// Threads whose stack is now deeper than the part kept in place (16 levels), so that it
// holds heap memory; a thread that ends with its scopes still open gives it back then.
// For tests.
TIDEPOOL_API int tag_stacks_on_heap() noexcept;

// The depth of this thread's tag stack.
TIDEPOOL_API int tag_depth() noexcept;

// Ends the scope whose push left this thread's stack `depth` deep: pops back to depth - 1,
// so that pushes left open inside the scope end with it. When its own tag was popped
// already (an unbalanced tidepool_tag_pop inside it), pops nothing. Either mismatch is
// said once per process on stderr (not under tidepool.log:off). Never throws: it runs in
// a destructor.
TIDEPOOL_API void end_tag_scope(int depth) noexcept;

// RAII scope: allocations made by this thread inside the scope carry `tag`. The stack is
// as it was before the scope when the scope ends, whatever was pushed or popped inside it
// (end_tag_scope).
class TIDEPOOL_API TagScope {
 public:
  explicit TagScope(int tag) : depth_((push_tag(tag), tag_depth())) {}
  explicit TagScope(std::string_view name) : TagScope(tag_id(name)) {}
  ~TagScope() { end_tag_scope(depth_); }
  TagScope(const TagScope&) = delete;
  TagScope& operator=(const TagScope&) = delete;

 private:
  int depth_;
};

}  // namespace tidepool
