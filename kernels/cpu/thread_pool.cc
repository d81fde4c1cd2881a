#include "thread_pool.h"

#include <cstdlib>

namespace msa_ops {
namespace cpu {

namespace {
int default_threads() {
  if (const char* env = std::getenv("MSA_OPS_NUM_THREADS")) {
    int v = std::atoi(env);
    if (v >= 1) return v > 256 ? 256 : v;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc > 256 ? 256 : hc);
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  // Intentionally leaked: joining threads during static destruction at interpreter exit is fragile.
  static ThreadPool* pool = new ThreadPool(default_threads());
  return *pool;
}

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain() {
  const auto& fn = *job_;
  const int64_t n = job_n_;
  for (int64_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i);
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (job_ == nullptr) continue;  // woke after that job was already finished
      ++active_;
    }
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> owner(busy_, std::try_to_lock);
  if (n == 1 || workers_.empty() || !owner.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    job_n_ = n;
    next_.store(0);
    ++generation_;
  }
  cv_.notify_all();
  drain();
  std::unique_lock<std::mutex> lk(mu_);
  // Workers that woke for this generation finish their drain before the job is released.
  done_cv_.wait(lk, [&] { return active_ == 0; });
  job_ = nullptr;
  job_n_ = 0;
}

}  // namespace cpu
}  // namespace msa_ops
