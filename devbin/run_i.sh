#!/usr/bin/env bash
# device call I (2 GPUs): tensor parallel decode with the all-reduces inside XLA's command buffers
set -u
OUT=${OUT:-out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
bash benchmarks/device_check.sh build > $OUT/build_step.log 2>&1; tail -1 $OUT/build_step.log
CB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES
i=0
for flags in "" "--xla_gpu_enable_command_buffer=$CB" "--xla_gpu_enable_command_buffer=$CB --xla_gpu_command_buffer_scheduling_mode=CONCURRENT"; do
  i=$((i+1)); tp="2"; [ $i = 1 ] && tp="1 2"
  XLA_FLAGS="$flags" timeout 110 python3 benchmarks/bench_model.py --tp $tp --ms 1 16 --formats nvfp4 --no-kernel-sum --no-append > $OUT/tp_$i.txt 2>&1
  echo "XLA_FLAGS=$flags"; grep "^# \|rror" $OUT/tp_$i.txt | cut -c1-40,90-175 | head -10
done
