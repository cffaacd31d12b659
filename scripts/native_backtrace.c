/* Preloaded (LD_PRELOAD) by `dev.sh gpu`: on a fatal signal, prints the
 * native stack (the frames Python's faulthandler cannot show), then dies of
 * the signal as before. It writes to the stderr the process started with
 * (pytest redirects descriptor 2 to a capture file that a crash loses).
 * Symbols are the exported ones; pipe through c++filt to read them. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int out_fd = 2;

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  void* frames[64];
  const int n = backtrace(frames, 64);
  char line[160];
  const int len = snprintf(line, sizeof line, "\n=== native stack: signal %d at address %p, thread %ld\n", sig,
                           info->si_addr, (long)syscall(SYS_gettid));
  if (write(out_fd, line, (size_t)len) < 0) { /* nothing to do */ }
  backtrace_symbols_fd(frames, n, out_fd);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  const int fd = fcntl(2, F_DUPFD_CLOEXEC, 3);
  if (fd >= 0) out_fd = fd;
  void* warm[1];
  backtrace(warm, 1);  /* loads libgcc's unwinder now, not inside the handler */
  static char alt[1 << 16];  /* a stack overflow still prints */
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (size_t k = 0; k < sizeof fatal / sizeof fatal[0]; ++k) sigaction(fatal[k], &sa, NULL);
}
