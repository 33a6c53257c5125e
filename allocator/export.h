// Symbol visibility for libtidepool: everything is hidden by default (see the top-level
// CMakeLists.txt); what a user may call is marked TIDEPOOL_API here.
#pragma once

#if defined(_WIN32)
#define TIDEPOOL_API __declspec(dllexport)
#else
#define TIDEPOOL_API __attribute__((visibility("default")))
#endif
