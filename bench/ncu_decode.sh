#!/usr/bin/env bash
# Nsight Compute sections for one fused decode-attention launch (kivi-2, B = 8, L = 32k,
# Llama-3-8B heads).  Needs a machine where ncu can read counters; clocks left alone.
timeout 240 ncu --clock-control none -k regex:DecodeAttentionKernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis python3 bench/ncu_one_launch.py kivi-2 8 32768 2>&1 | grep -v "^==PROF==" | tail -120
