// The emulator's runtime, linked into every emulated Metal kernel library:
// muser_kv_guarded runs a grid with SIGSEGV/SIGBUS caught, so an access to a
// guard page (or a write to a read-only input) is reported with its address
// instead of killing the test process.
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ucontext.h>

extern "C" {

struct muser_kv_fault {
  uint64_t address;
  int32_t signal;
  int32_t write;  // 1 write, 0 read, -1 unknown
};

}  // extern "C"

namespace {

sigjmp_buf g_jump;
volatile sig_atomic_t g_active = 0;
muser_kv_fault* g_fault = nullptr;

void on_fault(int sig, siginfo_t* info, void* context) {
  if (!g_active) {  // not a kernel's access: let the previous handling happen
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_fault->address = reinterpret_cast<uint64_t>(info->si_addr);
  g_fault->signal = sig;
#if defined(__linux__) && defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  g_fault->write = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
  (void)context;
  g_fault->write = -1;
#endif
  g_active = 0;
  siglongjmp(g_jump, 1);
}

}  // namespace

extern "C" int muser_kv_guarded(void (*run)(const void*), const void* launch,
                                muser_kv_fault* fault) {
  struct sigaction action;
  struct sigaction old_segv;
  struct sigaction old_bus;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &old_segv);
  sigaction(SIGBUS, &action, &old_bus);
  g_fault = fault;
  int faulted = 0;
  if (sigsetjmp(g_jump, 1) == 0) {
    g_active = 1;
    run(launch);
    g_active = 0;
  } else {
    faulted = 1;
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return faulted;
}
