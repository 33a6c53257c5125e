/* A stand-in for libcuda (the driver), for the LD_PRELOAD shim's exit check (Note [a
 * program the shim cannot see] in preload/libraries.cpp): a test copies it to libcuda.so.1
 * and loads it, as a process that used CUDA has the driver loaded. It defines nothing the
 * shim or tidepool calls. */
int cuInit(unsigned flags) {
  (void)flags;
  return 0;
}
