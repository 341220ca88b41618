// C++ twin of torch_ctrl/exit_gate.py: keeps the threads that wait for other ranks by polling
// the store out of torch while the process exits.
//
// A caller waiting on a FileStore (or on a TCPStore client shared by every caller: torch 2.6
// and 2.7 under PrefixStores) is never blocked in torch: it polls, calling into torch again
// after every pause, with the GIL released. Left running, a daemon thread doing so calls into
// torch's stores while the interpreter finalizes and the process runs its static destructors,
// and can crash it (SIGSEGV). Once the process exits (leave_process(), an atexit hook) such a
// thread parks at its next pause instead: it sleeps for good, between two calls into torch,
// and goes with the process. The thread that runs the exit never parks.
#pragma once

#include <cstdint>

namespace torch_ctrl::exit_gate {

// Whether the calling thread runs the exit (the interpreter's main thread): set by the
// bindings, which know it. A plain pointer: nothing to destroy while other threads still run.
extern bool (*runs_the_exit)();

// Marks the calling thread as inside a collective for its lifetime (twin of gated()): only
// such threads park, never a watcher's.
class Inside {
 public:
  Inside();
  ~Inside();
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
};

// Sleeps `seconds` between two polls of the store; inside a collective, once the process
// exits, parks there instead (before the pause or after it).
void pause(double seconds);

// Between two calls into torch in a collective that waits by other means than pause():
// parks the thread once the process exits. Inside a collective it counts as activity for
// settle(); elsewhere (a watcher's polls) it does nothing.
void checkpoint();

// How many threads this process parked at its exit (twin of parked()).
int64_t parked_threads();

// At exit, after leave_process(): waits until every thread inside a collective is parked, or
// none inside one has paused for `quiet` seconds (the rest are blocked in a call), at most
// `bound` seconds.
void settle(double quiet, double bound);

} // namespace torch_ctrl::exit_gate
