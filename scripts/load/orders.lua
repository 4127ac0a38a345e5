-- wrk script: POST /orders with a distinct Idempotency-Key per request.
-- Usage (against a running `keel serve`):
--   wrk -t2 -c64 -d20s --latency -s scripts/load/orders.lua http://127.0.0.1:8080
-- Each wrk thread gets its own key prefix, so keys never collide across threads.
-- Items come from the reference shop's catalogue (the plentiful skus), so every
-- order runs the whole saga: capture, reserve, ship, receipt. An unknown sku
-- would be refused by inventory, and the saga would only refund the capture.
local counter = 0
local skus = { "tea", "coffee", "mug", "kettle", "filter", "grinder" }

local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("prefix", string.format("wrk-%d-%d-%d-", os.time(), threads, math.random(1, 1e9)))
end

function init(args)
  prefix = prefix or string.format("wrk-%d-", math.random(1, 1e9))
end

request = function()
  counter = counter + 1
  local customer = "cust-" .. (counter % 500)
  local body = string.format(
    '{"customerId":"%s","currency":"USD","items":[{"sku":"%s","qty":1,"unitPriceCents":1299}]}',
    customer, skus[counter % #skus + 1])
  local headers = {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. counter,
  }
  return wrk.format("POST", "/orders", headers, body)
end
