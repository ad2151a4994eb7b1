// The emulator's runtime, linked into every emulated Metal kernel library:
//
//   * muser_kv_guarded runs a grid with SIGSEGV/SIGBUS caught, so an access to
//     a guard page (or a write to a read-only input) is reported with its
//     address instead of killing the test process;
//   * muser_kv_prepare / muser_kv_finish do a run's per-buffer chores around
//     it (fill the outputs, lay the canaries, make inputs read-only; then
//     writable again and the canaries checked), in C because a Python loop
//     over the buffers cost more than the kernels.
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <sys/mman.h>
#include <ucontext.h>

// One guarded buffer of a run (tests/guarded.py lays them out).
struct muser_kv_buffer {
  uint64_t pages;    // first data page
  uint64_t size;     // bytes of data pages
  uint64_t address;  // first data byte
  uint64_t nbytes;
  int32_t output;    // 1: an output (written by the kernel); 0: input or constant
  int32_t unused;
};

static const unsigned char kCanary = 0xC3;

static void lay_canary(const muser_kv_buffer& b) {
  std::memset(reinterpret_cast<void*>(b.pages), kCanary, b.address - b.pages);
  std::memset(reinterpret_cast<void*>(b.address + b.nbytes), kCanary,
              b.pages + b.size - b.address - b.nbytes);
}

static bool canary_intact(uint64_t from, uint64_t to) {
  for (const unsigned char* p = reinterpret_cast<const unsigned char*>(from);
       p < reinterpret_cast<const unsigned char*>(to); ++p) {
    if (*p != kCanary) return false;
  }
  return true;
}

// Outputs filled with `fill`, canaries laid, inputs read-only. 0, or -1 if an
// mprotect failed.
extern "C" int muser_kv_prepare(const muser_kv_buffer* buffers, int32_t count, int32_t fill) {
  for (int32_t i = 0; i < count; ++i) {
    const muser_kv_buffer& b = buffers[i];
    lay_canary(b);
    if (b.output) {
      std::memset(reinterpret_cast<void*>(b.address), fill, b.nbytes);
    } else if (mprotect(reinterpret_cast<void*>(b.pages), b.size, PROT_READ) != 0) {
      return -1;
    }
  }
  return 0;
}

// Inputs writable again (for the arena's next run); returns the index of the
// first buffer whose canary was overwritten, -1 if none, -2 if an mprotect failed.
extern "C" int muser_kv_finish(const muser_kv_buffer* buffers, int32_t count) {
  int spoiled = -1;
  for (int32_t i = 0; i < count; ++i) {
    const muser_kv_buffer& b = buffers[i];
    if (!b.output && mprotect(reinterpret_cast<void*>(b.pages), b.size, PROT_READ | PROT_WRITE) != 0) {
      return -2;
    }
    if (spoiled < 0 && !(canary_intact(b.pages, b.address) &&
                         canary_intact(b.address + b.nbytes, b.pages + b.size))) {
      spoiled = i;
    }
  }
  return spoiled;
}

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
