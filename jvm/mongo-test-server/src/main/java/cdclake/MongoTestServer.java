package cdclake;

import de.bwaldvogel.mongo.MongoServer;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import java.net.InetSocketAddress;
import java.util.concurrent.CountDownLatch;

/**
 * Starts mongo-java-server's in-memory backend with its oplog enabled (change streams need it; the library's own
 * main does not enable it) on a loopback address.
 *
 * <p>Usage: {@code java -cp '.jars/mongo-test-server/*' cdclake.MongoTestServer [HOST [PORT]]}; HOST defaults to
 * 127.0.0.1 and PORT to 0 (a free port). Once bound, prints exactly one line {@code listening HOST:PORT} on stdout
 * with the bound port. Runs until the JVM is asked to stop (SIGTERM, SIGINT): a shutdown hook then closes the
 * server. The server logs warnings and errors on stderr (more with
 * {@code -Dorg.slf4j.simpleLogger.defaultLogLevel=info}). All data lives in memory and is gone when the process ends.
 */
public final class MongoTestServer {
  private MongoTestServer() {}

  public static void main(String[] args) throws InterruptedException {
    if (args.length > 2) {
      System.err.println("usage: cdclake.MongoTestServer [HOST [PORT]]");
      System.exit(2);
    }
    if (System.getProperty("org.slf4j.simpleLogger.defaultLogLevel") == null) {
      System.setProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn");
    }
    String host = args.length > 0 ? args[0] : "127.0.0.1";
    int port = args.length > 1 ? Integer.parseInt(args[1]) : 0;

    MemoryBackend backend = new MemoryBackend();
    backend.enableOplog();
    MongoServer server = new MongoServer(backend);
    server.bind(host, port);
    InetSocketAddress address = server.getLocalAddress();

    CountDownLatch stopped = new CountDownLatch(1);
    Runtime.getRuntime()
        .addShutdownHook(
            new Thread(
                () -> {
                  server.shutdownNow();
                  stopped.countDown();
                },
                "mongo-test-server-shutdown"));
    System.out.println("listening " + host + ":" + address.getPort());
    System.out.flush();
    stopped.await();
  }
}
