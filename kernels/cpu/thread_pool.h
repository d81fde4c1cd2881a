// A tiny persistent thread pool for the CPU handlers. The calling thread takes part in the work; if the
// pool is busy (another handler runs concurrently) the caller runs everything itself, so nothing can
// deadlock. Threads: MSA_OPS_NUM_THREADS or std::thread::hardware_concurrency().
#ifndef MSA_OPS_CPU_THREAD_POOL_H_
#define MSA_OPS_CPU_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace msa_ops {
namespace cpu {

class ThreadPool {
 public:
  static ThreadPool& instance();

  // Calls fn(i) for i in [0, n), spread over the pool. Blocks until all calls returned.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);
  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller that owns the current job
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<int64_t> next_{0};
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_THREAD_POOL_H_
