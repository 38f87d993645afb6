// Users and ACLs on a test broker started by `kafka.sh start-secure`, through Kafka's Admin API (kafka-clients,
// already on the broker's classpath; compiled once into the cache by kafka.sh). Each command returns only once
// the broker acts on it:
//   KafkaAdmin CLIENT_PROPERTIES add-user NAME PASSWORD
//       a SCRAM-SHA-512 credential for NAME; waits until NAME can log in
//   KafkaAdmin CLIENT_PROPERTIES allow NAME OPERATIONS RESOURCE_TYPE RESOURCE [LITERAL|PREFIXED]
//       ALLOW ACLs for User:NAME from any host, one per operation (comma-separated, e.g.
//       `allow app WRITE,CREATE TOPIC orders`); waits until the broker's authorizer lists them
//   KafkaAdmin CLIENT_PROPERTIES revoke NAME OPERATIONS RESOURCE_TYPE RESOURCE [LITERAL|PREFIXED]
//       removes those ALLOW ACLs; waits until the broker's authorizer no longer lists them
// CLIENT_PROPERTIES holds bootstrap.servers and the super user's SASL_SSL settings.
import java.io.FileInputStream;
import java.util.Arrays;
import java.util.Collection;
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.errors.AuthorizationException;
import org.apache.kafka.common.errors.SaslAuthenticationException;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class KafkaAdmin {
    static final long DEADLINE_MS = 60_000;

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            usage();
        }
        Properties properties = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            properties.load(in);
        }
        try (Admin admin = Admin.create(properties)) {
            switch (args[1]) {
                case "add-user" -> {
                    if (args.length != 4) usage();
                    addUser(admin, properties, args[2], args[3]);
                }
                case "allow" -> {
                    if (args.length != 6 && args.length != 7) usage();
                    PatternType pattern = args.length == 7 ? PatternType.fromString(args[6]) : PatternType.LITERAL;
                    List<AclOperation> operations =
                        Arrays.stream(args[3].split(",")).map(AclOperation::fromString).toList();
                    allow(admin, args[2], operations, ResourceType.fromString(args[4]), args[5], pattern);
                }
                case "revoke" -> {
                    if (args.length != 6 && args.length != 7) usage();
                    PatternType pattern = args.length == 7 ? PatternType.fromString(args[6]) : PatternType.LITERAL;
                    List<AclOperation> operations =
                        Arrays.stream(args[3].split(",")).map(AclOperation::fromString).toList();
                    revoke(admin, args[2], operations, ResourceType.fromString(args[4]), args[5], pattern);
                }
                default -> usage();
            }
        }
    }

    static void usage() {
        System.err.println("usage: KafkaAdmin CLIENT_PROPERTIES add-user NAME PASSWORD");
        System.err.println("       KafkaAdmin CLIENT_PROPERTIES allow NAME OPERATIONS RESOURCE_TYPE RESOURCE [LITERAL|PREFIXED]");
        System.err.println("       KafkaAdmin CLIENT_PROPERTIES revoke NAME OPERATIONS RESOURCE_TYPE RESOURCE [LITERAL|PREFIXED]");
        System.exit(2);
    }

    static void addUser(Admin admin, Properties superUser, String name, String password) throws Exception {
        ScramCredentialInfo info = new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192);
        admin.alterUserScramCredentials(List.of(new UserScramCredentialUpsertion(name, info, password)))
            .all().get();
        // The controller has the credential; the broker learns it from the metadata log a moment later.
        Properties user = new Properties();
        user.putAll(superUser);
        user.put("sasl.jaas.config", "org.apache.kafka.common.security.scram.ScramLoginModule required username=\""
            + name + "\" password=\"" + password + "\";");
        long deadline = System.currentTimeMillis() + DEADLINE_MS;
        while (true) {
            try (Admin login = Admin.create(user)) {
                login.describeCluster().clusterId().get();
                return;
            } catch (Exception e) {
                Throwable cause = e.getCause() != null ? e.getCause() : e;
                if (cause instanceof AuthorizationException) {
                    return; // logged in; it just may not describe the cluster
                }
                if (!(cause instanceof SaslAuthenticationException) || System.currentTimeMillis() > deadline) {
                    throw e;
                }
            }
            Thread.sleep(100);
        }
    }

    static List<AclBinding> bindings(String name, List<AclOperation> operations, ResourceType type,
                                     String resource, PatternType pattern) {
        if (operations.contains(AclOperation.UNKNOWN) || type == ResourceType.UNKNOWN
            || pattern == PatternType.UNKNOWN) {
            usage();
        }
        ResourcePattern on = new ResourcePattern(type, resource, pattern);
        return operations.stream()
            .map(operation -> new AclBinding(on,
                new AccessControlEntry("User:" + name, "*", operation, AclPermissionType.ALLOW)))
            .toList();
    }

    static void allow(Admin admin, String name, List<AclOperation> operations, ResourceType type,
                      String resource, PatternType pattern) throws Exception {
        List<AclBinding> bindings = bindings(name, operations, type, resource, pattern);
        admin.createAcls(bindings).all().get();
        // DescribeAcls is answered from the broker's own authorizer: listed there, an ACL is in force.
        long deadline = System.currentTimeMillis() + DEADLINE_MS;
        for (AclBinding binding : bindings) {
            while (true) {
                Collection<AclBinding> listed = admin.describeAcls(binding.toFilter()).values().get();
                if (listed.contains(binding)) {
                    break;
                }
                if (System.currentTimeMillis() > deadline) {
                    throw new IllegalStateException("the broker does not list " + binding + " after 60 s");
                }
                Thread.sleep(100);
            }
        }
    }

    static void revoke(Admin admin, String name, List<AclOperation> operations, ResourceType type,
                       String resource, PatternType pattern) throws Exception {
        List<AclBinding> bindings = bindings(name, operations, type, resource, pattern);
        admin.deleteAcls(bindings.stream().map(AclBinding::toFilter).toList()).all().get();
        long deadline = System.currentTimeMillis() + DEADLINE_MS;
        for (AclBinding binding : bindings) {
            while (admin.describeAcls(binding.toFilter()).values().get().contains(binding)) {
                if (System.currentTimeMillis() > deadline) {
                    throw new IllegalStateException("the broker still lists " + binding + " after 60 s");
                }
                Thread.sleep(100);
            }
        }
    }
}
