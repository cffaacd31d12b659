/* Preloaded (LD_PRELOAD) by `dev.sh gpu`: on a fatal signal, prints the
 * native stack (the frames Python's faulthandler cannot show) to stderr,
 * then dies of the signal as before. Symbols are the exported ones; pipe
 * through c++filt to read them. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  void* frames[64];
  const int n = backtrace(frames, 64);
  char line[160];
  const int len = snprintf(line, sizeof line, "\n=== native stack: signal %d at address %p, thread %ld\n", sig,
                           info->si_addr, (long)gettid());
  if (write(2, line, (size_t)len) < 0) { /* nothing to do */ }
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGILL, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
}
