// tests/slurm: task 1 enters a PMIx fence (over the whole job) 2 s late; task 0 prints how long it
// waited in it, in seconds. A fence that works waits about 2 s.
#include <pmix.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(void) {
  pmix_proc_t me;
  if (PMIx_Init(&me, NULL, 0) != PMIX_SUCCESS) return 1;
  if (me.rank == 1) sleep(2);
  const double t = now();
  if (PMIx_Fence(NULL, 0, NULL, 0) != PMIX_SUCCESS) return 1;
  if (me.rank == 0) printf("%.3f\n", now() - t);
  PMIx_Finalize(NULL, 0);
  return 0;
}
