// Lock annotations that clang's -Wthread-safety checks (the top-level CMakeLists turns it on
// for clang builds; under WEIGHTFS_WERROR a violation fails the build). Under other compilers
// they expand to nothing. Written after the macros of Abseil and LevelDB, prefixed WFS_.
//
// The convention (see README, "Lock rules"): a mutex is a weightfs::Mutex (core/mutex.h); each
// member it protects says WFS_GUARDED_BY(mu_); a private helper that expects the lock held says
// WFS_REQUIRES(mu_); a public function that takes the lock itself may say WFS_EXCLUDES(mu_).
// WFS_NO_THREAD_SAFETY_ANALYSIS is the escape hatch, always with a comment saying why.
#pragma once

#if defined(__clang__)
#define WFS_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define WFS_THREAD_ANNOTATION_(x)
#endif

// A type that is a capability (a mutex): WFS_CAPABILITY("mutex").
#define WFS_CAPABILITY(x) WFS_THREAD_ANNOTATION_(capability(x))
// An RAII type that holds a capability for its lifetime (MutexLock).
#define WFS_SCOPED_CAPABILITY WFS_THREAD_ANNOTATION_(scoped_lockable)

// A data member read or written only with the capability held.
#define WFS_GUARDED_BY(x) WFS_THREAD_ANNOTATION_(guarded_by(x))
// A pointer member whose pointee is read or written only with the capability held.
#define WFS_PT_GUARDED_BY(x) WFS_THREAD_ANNOTATION_(pt_guarded_by(x))

// Lock order: this capability is taken before / after the ones named.
#define WFS_ACQUIRED_BEFORE(...) WFS_THREAD_ANNOTATION_(acquired_before(__VA_ARGS__))
#define WFS_ACQUIRED_AFTER(...) WFS_THREAD_ANNOTATION_(acquired_after(__VA_ARGS__))

// The caller must hold the capability (exclusively / at least shared) when calling.
#define WFS_REQUIRES(...) WFS_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define WFS_REQUIRES_SHARED(...) WFS_THREAD_ANNOTATION_(requires_shared_capability(__VA_ARGS__))
// The caller must not hold the capability (the function takes it itself).
#define WFS_EXCLUDES(...) WFS_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))

// The function takes / releases the capability (exclusively), or the shared form.
#define WFS_ACQUIRE(...) WFS_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define WFS_ACQUIRE_SHARED(...) WFS_THREAD_ANNOTATION_(acquire_shared_capability(__VA_ARGS__))
#define WFS_RELEASE(...) WFS_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define WFS_RELEASE_SHARED(...) WFS_THREAD_ANNOTATION_(release_shared_capability(__VA_ARGS__))
// The function takes the capability iff it returns the first argument (true).
#define WFS_TRY_ACQUIRE(...) WFS_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))

// The function checks (at run time or by construction) that the capability is held.
#define WFS_ASSERT_CAPABILITY(x) WFS_THREAD_ANNOTATION_(assert_capability(x))
// The function returns a reference to the capability.
#define WFS_RETURN_CAPABILITY(x) WFS_THREAD_ANNOTATION_(lock_returned(x))

// Turns the analysis off for one function. Say why next to it.
#define WFS_NO_THREAD_SAFETY_ANALYSIS WFS_THREAD_ANNOTATION_(no_thread_safety_analysis)
