// The LibTorch half of the installed-package check: Apollo with its state in a tiered
// store on the host backend takes steps on a small regression problem and lowers the
// loss. Only built when the installed tidepool has tidepool::optim.
#include <cstdio>
#include <memory>

#include <torch/torch.h>

#include "allocator/backend.h"
#include "optimizers/apollo.h"
#include "optimizers/tiered_placement.h"

int run_optimizer_check() {
  torch::manual_seed(0);
  auto backend = tidepool::make_host_backend();
  tidepool::TieredStoreOptions options;
  options.device_budget_bytes = 1 << 20;
  auto store = std::make_shared<tidepool::TieredStore>(*backend, options);
  auto placement = std::make_shared<tidepool::optim::TieredPlacement>(store);

  const auto x = torch::randn({256, 16});
  const auto y = x.matmul(torch::randn({16, 1}));
  auto w = torch::zeros({16, 1}, torch::requires_grad());
  double first_loss = 0.0, last_loss = 0.0;
  {
    tidepool::optim::Apollo apollo({w}, tidepool::optim::ApolloOptions(0.01).warmup(10), placement);
    for (int step = 0; step < 100; ++step) {
      apollo.zero_grad();
      auto loss = (x.matmul(w) - y).pow(2).mean();
      loss.backward();
      apollo.step();
      (step == 0 ? first_loss : last_loss) = loss.item<double>();
    }
  }
  if (!(last_loss < 0.5 * first_loss)) {
    std::fprintf(stderr, "tidepool_consumer: Apollo did not lower the loss (%g -> %g)\n",
                 first_loss, last_loss);
    return 1;
  }
  return 0;
}
