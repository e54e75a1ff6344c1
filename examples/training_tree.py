import yr
import time

# 创建有状态函数类实例并设置其运行所需资源(1核CPU)
opt = yr.InvokeOptions(cpu=1000)


# --- 2. 底层:执行实际训练的 Worker ---
@yr.instance(invoke_options=opt)
class TrainingWorker:
    def train(self, shard_id, hyperparams):
        # 模拟训练过程
        lr = hyperparams["lr"]
        print(f"Worker {shard_id} 正在使用 lr={lr} 训练数据分片...")
        time.sleep(2)
        return f"Loss: {0.1 / lr}"


# --- 1. 中层:负责编排的 Supervisor ---
@yr.instance(invoke_options=opt)
class TrainingSupervisor:
    def __init__(self, hyperparams):
        self.hyperparams = hyperparams
        self.workers = []

    def start_training(self, num_workers):
        # 动态创建属于自己的 Worker 团队
        self.workers = [TrainingWorker.invoke() for i in range(num_workers)]

        # 调度所有 Worker 并行训练数据分片
        results = yr.get([
            w.train.invoke(i, self.hyperparams)
            for i, w in enumerate(self.workers)
        ])
        return f"超参数 {self.hyperparams} 试验完成,结果: {results}"


# --- 主控端 ---
# yrdask: the seed calls yr.init() with no arguments.  Its six instances (2 supervisors and
# 4 workers) each hold a full CPU (cpu=1000) for their whole life, so the embedded cluster
# must offer six CPUs; on a smaller machine num_cpus=6 spreads those six CPUs over one
# worker process per core.  This is the only line changed from the seed.
yr.init(yr.Config(num_cpus=6))

# 并行启动两个不同超参数的试验(两个 Supervisor)
configs = [{"lr": 0.01}, {"lr": 0.001}]
supervisors = [TrainingSupervisor.invoke(cfg) for cfg in configs]

# 所有的试验并行运行
final_reports = yr.get([s.start_training.invoke(num_workers=2) for s in supervisors])

for report in final_reports:
    print(report)

yr.finalize()
