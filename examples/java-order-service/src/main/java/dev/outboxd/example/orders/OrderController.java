package dev.outboxd.example.orders;

import java.util.List;
import java.util.Map;
import java.util.UUID;

import org.springframework.http.HttpStatus;
import org.springframework.http.ResponseEntity;
import org.springframework.web.bind.annotation.ExceptionHandler;
import org.springframework.web.bind.annotation.GetMapping;
import org.springframework.web.bind.annotation.PathVariable;
import org.springframework.web.bind.annotation.PostMapping;
import org.springframework.web.bind.annotation.RequestBody;
import org.springframework.web.bind.annotation.RequestMapping;
import org.springframework.web.bind.annotation.RestController;

/**
 * The order API:
 * <pre>
 * POST /orders                {"customerId": "c-1", "card": "4242424242424242", "lines": [{"sku": "a", "quantity": 2}]}
 *                             201 {"orderId": "..."}
 * POST /orders/{id}/confirm   200, 402 when the payment is declined (nothing changed, no event), 409 if not placed
 * POST /orders/{id}/cancel    200, 409 when already cancelled
 * GET  /orders/{id}           200 the order, 404
 * </pre>
 */
@RestController
@RequestMapping("/orders")
public class OrderController {
    public record PlaceOrder(String customerId, String card, List<OrderService.Line> lines) {}

    private final OrderService orders;

    public OrderController(OrderService orders) {
        this.orders = orders;
    }

    @PostMapping
    public ResponseEntity<Map<String, Object>> place(@RequestBody PlaceOrder request) {
        if (request.customerId() == null || request.card() == null || request.lines() == null
                || request.lines().isEmpty()) {
            return ResponseEntity.badRequest()
                    .body(Map.of("error", "customerId, card and at least one line are required"));
        }
        UUID orderId = orders.placeOrder(request.customerId(), request.card(), request.lines());
        return ResponseEntity.status(HttpStatus.CREATED).body(Map.of("orderId", orderId));
    }

    @PostMapping("/{orderId}/confirm")
    public Map<String, Object> confirm(@PathVariable UUID orderId) {
        orders.confirmOrder(orderId);
        return Map.of("orderId", orderId, "status", "CONFIRMED");
    }

    @PostMapping("/{orderId}/cancel")
    public Map<String, Object> cancel(@PathVariable UUID orderId) {
        orders.cancelOrder(orderId);
        return Map.of("orderId", orderId, "status", "CANCELLED");
    }

    @GetMapping("/{orderId}")
    public ResponseEntity<OrderService.Order> get(@PathVariable UUID orderId) {
        return ResponseEntity.of(orders.find(orderId));
    }

    @ExceptionHandler
    public ResponseEntity<Map<String, Object>> declined(PaymentGateway.PaymentDeclinedException e) {
        return ResponseEntity.status(HttpStatus.PAYMENT_REQUIRED).body(Map.of("error", e.getMessage()));
    }

    @ExceptionHandler
    public ResponseEntity<Map<String, Object>> invalid(OrderService.InvalidTransitionException e) {
        return ResponseEntity.status(HttpStatus.CONFLICT).body(Map.of("error", e.getMessage()));
    }
}
