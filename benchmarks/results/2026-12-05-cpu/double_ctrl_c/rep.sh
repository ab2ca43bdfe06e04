# usage: rep.sh N -> rc per try
source /work/venv/bin/activate
cd /work/dint
for i in $(seq 1 $1); do
  rm -rf run$i
  PYTHONFAULTHANDLER=1 moe-tune output_dir=/work/dint/run$i train.steps=30 checkpoint.every=5 train.log_every=5 train.precision=fp32 > log$i 2>&1 &
  P=$!
  for t in $(seq 1 600); do grep -q "step 10 |" log$i 2>/dev/null && break; sleep 0.05; done
  kill -INT $P; sleep 0.02; kill -INT $P
  wait $P; echo "try $i rc=$?"
done
