"""Actor side: admission, the link to the learner, weight sync, batched generation, and the loop that ties them."""
